"""The four Triton kernels of ``fused_encode.py``, which code a span of streams as
``device_encode.py``'s torch encoder does, byte for byte.

- :func:`plan_kernel`, one program per stream-block: the mean (float64 sums of ``x / n``,
  rounded to float32, then to the skeleton dtype), each component's scale (the square root
  of the float64 variance around the rounded mean, to float16 through float32), and the
  greedy water-filling of the stream's bits. The greedy takes the largest marginal gains
  ``sigma_j^2 * (D(b) - D(b + 1))`` first, the lowest component among equals: that is the
  gains above the ``budget``-th largest, found by bisecting its float64 bits (gains are
  nonnegative, so their bits order as they do), then the equal ones by component. It also
  counts the values the codec refuses (non-finite, past its range).
- :func:`codes_kernel`, one program per tile of ``fused_decode.BLOCK_N`` vectors: where its
  stream-block's codes start (the bytes of those before it, the earlier parts' padding), the
  scaled coefficients, their codes by bisecting the codebook's midpoints (ties go up, as
  ``searchsorted(right=True)``), OR-ed into the packed stream by 32-bit atomics (a tile's bits
  start on a byte: neighbours share at most a word), and the tile's count of outliers.
- :func:`totals_kernel`, one program: where each part's codes and outliers start, where each
  tile's outliers start in its part's, and what the host waits for once (the code bytes, the
  outliers, the values refused).
- :func:`outliers_kernel`, only where there are outliers: each tile's, in the order of their
  positions, with their decoded values ``mean + float16(z) * sigma``.

Float32 steps are IEEE-rounded (``div_rn``; launched with fused multiply-adds off), so a
GPU gives the torch encoder's bytes but for the order float64 sums are added in.
"""

from __future__ import annotations

from .triton_support import bf16_bits, program_tile, tl, triton

__all__ = ["codes_kernel", "outliers_kernel", "plan_kernel", "totals_kernel"]

if triton is not None:
    #: Bits of float64 +inf: above every gain.
    _INF_BITS = tl.constexpr(0x7FF0000000000000)

    @triton.jit
    def _scaled(y, mean, sigma, k, t, j, n, d):
        """The scaled coefficients ``z`` of vectors ``t`` x components ``j`` of stream-block
        ``k`` (``(x - mean) / sigma``, clamped to the codec's range; 0 where sigma is 0),
        where they are in the block, and the components' rounded means and scales."""
        jm = j < d
        ok = (t < n)[:, None] & jm[None, :]
        s = tl.load(sigma + k * d + j, mask=jm, other=0).to(tl.float32)
        m = tl.load(mean + k * d + j, mask=jm, other=0).to(tl.float32)
        x = tl.load(y + (k * n + t.to(tl.int64))[:, None] * d + j[None, :], mask=ok, other=0.0)
        c = x - m[None, :]
        z = tl.div_rn(c, tl.where(s > 0, s, 1.0)[None, :])
        z = tl.minimum(tl.maximum(z, -60000.0), 60000.0)
        return tl.where((s > 0)[None, :], z, 0.0), ok, m, s

    @triton.jit
    def _gain_bits(sigma, drops, k, j, d, WIDTH: tl.constexpr):
        """``[BLOCK_D, WIDTH]`` int64: the float64 bits of each component's marginal gains
        ``float32(sigma^2) * drop_b`` (-1 past ``d``: below every gain)."""
        jm = j < d
        s = tl.load(sigma + k * d + j, mask=jm, other=0).to(tl.float32)
        g = (s * s).to(tl.float64)[:, None] * tl.load(drops + tl.arange(0, WIDTH))[None, :]
        return tl.where(jm[:, None], g.to(tl.int64, bitcast=True), -1)

    @triton.jit
    def plan_kernel(
        y,  # float32 [K, n, d]
        budget,  # int64 [K]: bits per vector
        drops,  # float64 [WIDTH]: D(b) - D(b + 1)
        mean,  # [K, d] out: the skeleton dtype (bfloat16 as its int16 bits)
        sigma,  # float16 [K, d] out
        bits,  # uint8 [K, d] out
        per_vector,  # int64 [K] out
        bad,  # int32 [K] out: whether a value is non-finite or past the codec's range
        n,
        d,
        SKELETON: tl.constexpr,  # 0 float16, 1 bfloat16, 2 float32
        WIDTH: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        k = tl.program_id(0).to(tl.int64)
        # The codec's weights. (A GPU divides and takes square roots of float64 IEEE-rounded
        # only: there is no approximate float64 form.)
        w = 1.0 / (n + tl.zeros([], dtype=tl.int64)).to(tl.float64)
        positive = 0
        refused = 0
        for j0 in range(0, d, BLOCK_D):
            j = j0 + tl.arange(0, BLOCK_D)
            jm = j < d
            acc = tl.zeros([BLOCK_D], dtype=tl.float64)
            for t0 in range(0, n, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                at = (k * n + t.to(tl.int64))[:, None] * d + j[None, :]
                x = tl.load(y + at, mask=(t < n)[:, None] & jm[None, :], other=0.0)
                acc += tl.sum(x.to(tl.float64) * w, axis=0)
                out = (tl.abs(x) <= 60000.0) == 0  # NaN too
                refused += tl.sum(tl.sum(out.to(tl.int32), axis=1), axis=0)
            m = acc.to(tl.float32)
            if SKELETON == 0:
                m16 = m.to(tl.float16)
                tl.store(mean + k * d + j, m16, mask=jm)
                m = m16.to(tl.float32)
            elif SKELETON == 1:  # rounded by its bits, as torch rounds (the interpreter truncates)
                b16 = bf16_bits(m)
                tl.store(mean + k * d + j, b16.to(tl.int16), mask=jm)
                m = (b16 << 16).to(tl.float32, bitcast=True)
            else:
                tl.store(mean + k * d + j, m, mask=jm)
            var = tl.zeros([BLOCK_D], dtype=tl.float64)
            for t0 in range(0, n, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                ok = (t < n)[:, None] & jm[None, :]
                at = (k * n + t.to(tl.int64))[:, None] * d + j[None, :]
                c = (tl.load(y + at, mask=ok, other=0.0) - m[None, :]).to(tl.float64)
                var += tl.sum(tl.where(ok, (c * w) * c, 0.0), axis=0)
            s = tl.minimum(tl.sqrt(var), 60000.0).to(tl.float32).to(tl.float16)
            tl.store(sigma + k * d + j, s, mask=jm)
            sf = s.to(tl.float32)
            positive += tl.sum(tl.where(jm & (sf * sf > 0), WIDTH, 0), axis=0)
        tl.debug_barrier()  # the scales, written by every thread, read by every thread below
        want = tl.load(budget + k)
        # The first components' gains, kept (every component's where d fits one step).
        g0 = _gain_bits(sigma, drops, k, tl.arange(0, BLOCK_D), d, WIDTH)
        # Bits of the smallest gain the greedy takes all of (above it: everything it takes).
        cut = tl.zeros([], dtype=tl.int64)
        if want == 0:
            cut += _INF_BITS
        elif want < positive:  # the want-th largest gain: max t with want gains >= t
            lo = tl.zeros([], dtype=tl.int64)
            hi = lo + _INF_BITS
            for _ in range(63):
                mid = lo + (hi - lo) // 2
                over = tl.sum(tl.sum((g0 >= mid).to(tl.int64), axis=1), axis=0)
                for j0 in range(BLOCK_D, d, BLOCK_D):
                    g = _gain_bits(sigma, drops, k, j0 + tl.arange(0, BLOCK_D), d, WIDTH)
                    over += tl.sum(tl.sum((g >= mid).to(tl.int64), axis=1), axis=0)
                if over >= want:
                    lo = mid
                else:
                    hi = mid
            cut += lo
        # Past the gains above the cut, those equal to it by component, as many as wanted
        # (a component's gains fall strictly with b: at most one of them equals it). Where
        # every positive gain is taken (cut 0) none is wanted; where none (+inf) none equals.
        above = tl.sum(tl.sum((g0 > cut).to(tl.int64), axis=1), axis=0)
        for j0 in range(BLOCK_D, d, BLOCK_D):
            g = _gain_bits(sigma, drops, k, j0 + tl.arange(0, BLOCK_D), d, WIDTH)
            above += tl.sum(tl.sum((g > cut).to(tl.int64), axis=1), axis=0)
        ties = tl.where(cut > 0, want - above, 0)
        seen = tl.zeros([], dtype=tl.int64)
        total = tl.zeros([], dtype=tl.int64)
        for j0 in range(0, d, BLOCK_D):
            j = j0 + tl.arange(0, BLOCK_D)
            g = _gain_bits(sigma, drops, k, j, d, WIDTH)
            tie = tl.sum((g == cut).to(tl.int64), axis=1)
            rank = seen + tl.cumsum(tie, axis=0) - tie
            b = tl.sum((g > cut).to(tl.int64), axis=1) + tie * (rank < ties).to(tl.int64)
            tl.store(bits + k * d + j, b.to(tl.uint8), mask=j < d)
            total += tl.sum(b, axis=0)
            seen += tl.sum(tie, axis=0)
        tl.store(per_vector + k, total)
        tl.store(bad + k, refused)

    @triton.jit
    def codes_kernel(
        y,  # float32 [K, n, d]
        mean,  # [K, d], the skeleton dtype
        sigma,  # float16 [K, d]
        bits,  # uint8 [K, d]
        per_vector,  # int64 [K]
        bounds,  # float32 [widths, LEVELS]: each codebook's midpoints, +inf-padded
        part,  # int64 [K]: each stream-block's part
        part_first,  # int64 [K]: its part's first stream-block
        base,  # int64 [K] out: where each stream-block's codes start in its part's
        words,  # int32, zeroed: the packed codes, little-endian, each part's then PAD zeros
        room,  # its words (a refused input's bits may not fit: never written past)
        counts,  # int32 [K * tiles] out: outliers per tile
        n,
        d,
        threshold,
        LEVELS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAD: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        k, t = program_tile(BLOCK_N)
        # The stream-block starts after the whole bytes of those before it, the earlier
        # parts' padding, and (in its part's codes) after its part's earlier ones.
        lo = tl.load(part_first + k)
        at = tl.load(part + k) * PAD
        inside = tl.zeros([], dtype=tl.int64)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            size = (tl.load(per_vector + kk, mask=kk < k, other=0) * n + 7) // 8
            at += tl.sum(size, axis=0)
            inside += tl.sum(tl.where(kk >= lo, size, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(base + k, inside)
        first = at * 8 + t.to(tl.int64) * tl.load(per_vector + k)
        over = 0
        for j0 in range(0, d, BLOCK_D):
            j = j0 + tl.arange(0, BLOCK_D)
            z, ok, _m, _s = _scaled(y, mean, sigma, k, t, j, n, d)
            b = tl.load(bits + k * d + j, mask=j < d, other=0).to(tl.int32)
            # The number of midpoints <= z in the row of width b (+inf pads: never).
            code = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.int32)
            for step in tl.static_range(7, -1, -1):
                up = code + (1 << step)
                mid = tl.load(bounds + (b * LEVELS)[None, :] + up - 1, mask=ok, other=0.0)
                code = tl.where(ok & (mid <= z), up, code)
            start = first[:, None] + (tl.cumsum(b, axis=0) - b).to(tl.int64)[None, :]
            word = start >> 5
            shift = (start & 31).to(tl.uint32)
            low = (code.to(tl.uint32) << shift).to(tl.int32, bitcast=True)
            put = ok & (code != 0) & (word < room)
            tl.atomic_or(words + word, low, mask=put, sem="relaxed")
            spill = (shift.to(tl.int32) + b[None, :]) > 32  # the code runs into the next word
            rest = code >> tl.where(spill, 32 - shift.to(tl.int32), 0)
            put = ok & spill & (rest != 0) & (word + 1 < room)
            tl.atomic_or(words + word + 1, rest, mask=put, sem="relaxed")
            first += tl.sum(b, axis=0).to(tl.int64)
            over += tl.sum(tl.sum((ok & (tl.abs(z) > threshold)).to(tl.int32), axis=1), axis=0)
        tl.store(counts + k * tl.num_programs(1) + tl.program_id(1), over)

    @triton.jit
    def outliers_kernel(
        y,  # float32 [K, n, d]
        mean,  # [K, d], the skeleton dtype
        sigma,  # float16 [K, d]
        part,  # int64 [K]: each stream-block's part
        part_first,  # int64 [K]: its part's first stream-block
        starts,  # int64 [K * tiles + parts]: where each tile's outliers start in its part's
        offsets,  # int64: where each part's outliers start (from parts + 1 on)
        outlier_pos,  # int64 [m] out: into its part's [K', n, d] output, flattened
        outlier_dec,  # float32 [m] out: mean + float16(z) * sigma
        n,
        d,
        parts,
        threshold,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        k, t = program_tile(BLOCK_N)
        p = tl.load(part + k)
        tile = k * tl.num_programs(1) + tl.program_id(1) + p
        at = tl.load(starts + tile)
        if tl.load(starts + tile + 1) > at:
            at += tl.load(offsets + parts + 1 + p)
            shift = tl.load(part_first + k) * n * d  # positions in the part's output
            # In the order of their positions: vector by vector (each vector's first outlier
            # after the earlier vectors' count), then by component.
            per_vector = tl.zeros([BLOCK_N], dtype=tl.int64)
            for j0 in range(0, d, BLOCK_D):
                z, ok, _m, _s = _scaled(y, mean, sigma, k, t, j0 + tl.arange(0, BLOCK_D), n, d)
                per_vector += tl.sum((ok & (tl.abs(z) > threshold)).to(tl.int64), axis=1)
            first = at + tl.cumsum(per_vector, axis=0) - per_vector
            for j0 in range(0, d, BLOCK_D):
                j = j0 + tl.arange(0, BLOCK_D)
                z, ok, m, s = _scaled(y, mean, sigma, k, t, j, n, d)
                out = (ok & (tl.abs(z) > threshold)).to(tl.int64)
                rank = first[:, None] + tl.cumsum(out, axis=1) - out
                pos = (k * n + t.to(tl.int64))[:, None] * d + j[None, :] - shift
                dec = m[None, :] + z.to(tl.float16).to(tl.float32) * s[None, :]
                tl.store(outlier_pos + rank, pos, mask=out != 0)
                tl.store(outlier_dec + rank, dec, mask=out != 0)
                first += tl.sum(out, axis=1)

    @triton.jit
    def totals_kernel(
        per_vector,  # int64 [K]
        counts,  # int32 [K * tiles]: outliers per tile
        bad,  # int32 [K]: values refused per stream-block
        edges,  # int64 [parts + 1]: each part's first stream-block, then K
        starts,  # int64 [K * tiles + parts] out: each part's tiles' outlier starts, its total
        offsets,  # int64 [2 * (parts + 1) + 1] out: where each part's code bytes and
        # outliers start and (last) their ends; then the values refused
        n,
        k,
        parts,
        tiles,  # per stream-block
        PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        at = tl.zeros([], dtype=tl.int64)
        out = tl.zeros([], dtype=tl.int64)
        refused = tl.zeros([], dtype=tl.int64)
        for p in range(0, parts):
            lo = tl.load(edges + p)
            hi = tl.load(edges + p + 1)
            tl.store(offsets + p, at)
            tl.store(offsets + parts + 1 + p, out)
            for k0 in range(lo, hi, BLOCK):
                kk = k0 + tl.arange(0, BLOCK)
                size = (tl.load(per_vector + kk, mask=kk < hi, other=0) * n + 7) // 8
                at += tl.sum(size, axis=0)
                refused += tl.sum(tl.load(bad + kk, mask=kk < hi, other=0).to(tl.int64), axis=0)
            at += PAD
            seen = tl.zeros([], dtype=tl.int64)
            for i0 in range(lo * tiles, hi * tiles, BLOCK):
                i = i0 + tl.arange(0, BLOCK)
                c = tl.load(counts + i, mask=i < hi * tiles, other=0).to(tl.int64)
                tl.store(starts + i + p, seen + tl.cumsum(c, axis=0) - c, mask=i < hi * tiles)
                seen += tl.sum(c, axis=0)
            tl.store(starts + hi * tiles + p, seen)
            out += seen
        tl.store(offsets + parts, at)
        tl.store(offsets + 2 * parts + 1, out)
        tl.store(offsets + 2 * parts + 2, refused)

else:
    plan_kernel = codes_kernel = outliers_kernel = totals_kernel = None
