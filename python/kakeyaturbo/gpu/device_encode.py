"""Coding blocks with torch ops on the device the model runs on: the codec's water-filling
encoder, giving the :class:`~kakeyaturbo.gpu.device_decode.PackedRun` the device decoder reads.

A model on an accelerator whose cache holds its blocks there (``hf/layer.py``) would otherwise
copy each flushed span to the host, code it there and copy the codes back: on a GPU the
prompt's prefill then waits on the CPU for most of its time (``reports/gpu_h100.txt``). Here
the same blocks are coded where the tokens are, by a few dozen ops over every stream-block of
a flush (several layers' flushes together, ``Pipeline.encode_layers_on_device``).

The arithmetic is the codec's, in its order (``rust/kakeyaturbo/src/waterfill.rs``): the mean
in float64, rounded to float32 then to the skeleton dtype; each component's scale the square
root of its float64 variance, rounded to float16 through float32; greedy integer
water-filling of the layer's bits (here as one stable sort of every component's marginal
gains: the greedy picks them in that order); codes by the Gaussian codebooks' midpoints (ties
go up); outliers past the threshold kept exact in float16; codes packed LSB-first, vector
after vector. So on any device that rounds as IEEE does, the run equals ``PackedRun.of`` of
the codec's own blocks, byte for byte, but for the order float64 sums are added in (which
could move a float16 rounding, very rarely: never in tests/gpu/test_device_encode.py, which checks
equality, nor in a fuzz of 200 seeds).

On a GPU with Triton, ``fused_encode.py`` codes the same bytes in four kernel launches where
these torch ops are about 85 (its first span on each device checked against them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _core
from . import fused_decode, fused_encode
from .device_decode import (
    LEVELS,
    MAX_WIDTH,
    PAD,
    SKELETON_DTYPES,
    PackedRun,
    checked_parts,
    on_device,
    reads,
)

__all__ = ["encode_run", "encode_runs", "encode_runs_with_kernels"]

#: The codec's bound on input magnitudes and on a component's scale (``MAX_MAGNITUDE``).
MAX_MAGNITUDE = 60_000.0
#: The codec's limit on a vector's length (``MAX_HEAD_DIM``).
MAX_DIM = 4096
#: Values coded at once (a larger span is coded in pieces of whole stream-blocks).
CHUNK_VALUES = 1 << 22


def _bound_table() -> torch.Tensor:
    """``[MAX_WIDTH + 1, 255]`` float32: row ``b`` the midpoints between the ``b``-bit
    codebook's levels, padded with +inf (row 0 all +inf: a width-0 component's code is 0)."""
    table = torch.full((MAX_WIDTH + 1, (1 << MAX_WIDTH) - 1), float("inf"))
    for b in range(1, MAX_WIDTH + 1):
        levels = LEVELS[b, : 1 << b]  # the decoder's codebooks
        table[b, : (1 << b) - 1] = 0.5 * (levels[:-1] + levels[1:])  # float32, as the codec
    return table


def _gain_drops() -> torch.Tensor:
    """``[MAX_WIDTH]`` float64: what the ``b + 1``-th bit removes of a unit variance's
    distortion, ``D(b) - D(b + 1)``."""
    d = torch.tensor(_core.gaussian_distortions(), dtype=torch.float64)
    return d[:-1] - d[1:]


def _width_gains(metric: str) -> torch.Tensor:
    """``[MAX_WIDTH + 1]`` float32: the reconstruction gain per width (the codec's
    ``ip_gain`` for inner products, 1 for MSE)."""
    if metric != "inner_product":
        return torch.ones(MAX_WIDTH + 1)
    d = torch.tensor(_core.gaussian_distortions(), dtype=torch.float64)
    gains = (1.0 / (1.0 - d)).float()
    gains[0] = 1.0
    return gains


def encode_run(y: torch.Tensor, params: Any) -> PackedRun:
    """Code ``y`` ``[K, n, d]`` float32 (``K`` streams of ``n`` vectors, each one block) on
    ``y``'s device with ``params``: one ``kakeyaturbo.CodecParams`` (water-filled without a
    basis) for every stream, or a sequence of ``K``, one per stream, that differ in
    ``bits_per_value`` only (several layers' streams coded at once, each at its layer's rate).
    On a GPU with Triton by its kernels (``fused_encode.py``), else by torch ops."""
    return encode_runs(y, params)[0]


def encode_runs(
    y: torch.Tensor, params: Any, parts: Sequence[int] | None = None
) -> list[PackedRun]:
    """:func:`encode_run`, its stream-blocks in consecutive parts of ``parts`` stream-blocks
    (several layers' spans coded at once, a run per layer), each laid out as
    :meth:`PackedRun.split` lays out its parts. The kernels write the parts so (their tensors
    views of the call's); the torch ops split their run."""
    budgets, first = _checked(y, params)
    parts = _parts(parts, y.shape[0])
    with_torch = lambda: _encode_with_torch(y, budgets, first).split(parts)  # noqa: E731
    with_kernels = lambda: _encode_with_kernels(y, budgets, first, parts)  # noqa: E731
    if fused_encode.usable(y, with_torch, with_kernels, _check_range):
        return with_kernels()
    return with_torch()


def encode_runs_with_kernels(
    y: torch.Tensor, params: Any, parts: Sequence[int] | None = None
) -> list[PackedRun]:
    """:func:`encode_runs` by the Triton kernels wherever ``y`` is (on the CPU only in
    Triton's interpreter): for tests and benches."""
    budgets, first = _checked(y, params)
    return _encode_with_kernels(y, budgets, first, _parts(parts, y.shape[0]))


def _parts(parts: Sequence[int] | None, k: int) -> list[int]:
    """``parts`` checked to cover the ``k`` stream-blocks (None: one part of them all)."""
    return [k] if parts is None else checked_parts(parts, k)


def _checked(y: torch.Tensor, params: Any) -> tuple[list[int], Any]:
    """``y``'s shape and ``params`` checked as the codec checks them -> (each stream's bits
    per vector, the first stream's params). (Its values are checked where they are coded:
    by the torch encoder's one wait, by the kernels as they read them.)"""
    per_stream = not hasattr(params, "bits_per_value")
    streams = list(params) if per_stream else [params]
    first = streams[0]
    if not reads(first):
        raise ValueError(
            "encode_run codes water-filled blocks without a basis (pca_method='none', "
            f"allocation='waterfill'), got pca_method={first.pca_method!r}, "
            f"allocation={first.allocation!r}"
        )
    if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.dtype != torch.float32:
        got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"y must be float32 [streams, tokens, dim], got {got}")
    k, n, d = y.shape
    if k == 0 or n == 0 or d == 0 or d > MAX_DIM:
        raise ValueError(f"y: {k} streams of {n} vectors of length {d} (length 1..{MAX_DIM})")
    if per_stream:
        if len(streams) != k:
            raise ValueError(f"{len(streams)} CodecParams for {k} streams")
        same = first.replace(bits_per_value=1.0)
        distinct = {id(p): p for p in streams}.values()  # a layer's streams share its params
        if any(p.replace(bits_per_value=1.0) != same for p in distinct):
            raise ValueError("the streams' CodecParams differ in more than bits_per_value")
    # Each stream's bits per vector, as the codec rounds them (halves away from zero).
    rounded: dict[int, int] = {}  # by params: a layer's streams share its params
    for p in streams:
        rounded.setdefault(id(p), _round_half_away(float(p.bits_per_value) * d))
    return [rounded[id(p)] for p in (streams if per_stream else [first] * k)], first


def _encode_with_kernels(
    y: torch.Tensor, budgets: list[int], params: Any, parts: list[int]
) -> list[PackedRun]:
    dev = y.device
    tables = {
        "drops": on_device("drops", _gain_drops, dev),
        "bounds": on_device("bounds", _bound_table, dev),
        "gains": on_device(f"gains {params.metric}", lambda: _width_gains(params.metric), dev),
    }
    y = y.contiguous()
    return fused_encode.encode(y, budgets, params, tables, _check_range, parts)


def _encode_with_torch(y: torch.Tensor, budgets: list[int], params: Any) -> PackedRun:
    _check_range(y)
    budget = torch.tensor(budgets, device=y.device)
    k, n, d = y.shape
    # A long span is coded a bounded number of stream-blocks at a time: the steps below hold
    # a few dozen bytes per value at once.
    per = max(1, CHUNK_VALUES // (n * d))
    if k > per:
        parts = range(0, k, per)
        return PackedRun.cat([_encode(y[i : i + per], budget[i : i + per], params) for i in parts])
    return _encode(y, budget, params)


def _encode(y: torch.Tensor, budget: torch.Tensor, params: Any) -> PackedRun:
    """:func:`encode_run` of checked ``y`` ``[K, n, d]``, each stream with ``budget`` ``[K]``
    bits per vector."""
    k, n, d = y.shape
    dev = y.device
    # The codec's weights are 1/n each, in float64; its sums run over the vectors.
    w = 1.0 / n
    skeleton = SKELETON_DTYPES[params.skeleton_dtype]
    # In place where a step's input is not needed after it: a flush codes millions of values.
    mean = y.double().mul_(w).sum(dim=1).float().to(skeleton)  # [K, d], rounded as stored
    c = y - mean.float()[:, None, :]
    var = c.double().mul_(w).mul_(c).sum(dim=1)  # (w * c) * c, as the codec
    # Rounded to float16 through float32, as the codec rounds it.
    sigma = var.sqrt().clamp_max(MAX_MAGNITUDE).float().half()  # [K, d]
    sig = sigma.float()
    bits = _allocate(sig * sig, budget)  # [K, d] int64
    # Scaled coefficients; components of scale 0 are 0 (divided by 1, then selected).
    z = c.div_(torch.where(sig > 0, sig, 1.0)[:, None, :]).clamp_(-MAX_MAGNITUDE, MAX_MAGNITUDE)
    z.masked_fill_((sig == 0)[:, None, :], 0.0)
    bounds = on_device("bounds", _bound_table, dev)[bits]  # [K, d, 255]
    flat = z.transpose(1, 2).contiguous()
    codes = torch.searchsorted(bounds, flat, right=True, out_int32=True)  # [K, d, n]
    del flat, bounds
    packed, base, per_vector = _pack(codes.transpose(1, 2), bits, n)
    # Its own copy, as PackedRun.of makes one: each run counts the bytes it holds.
    gains = on_device(f"gains {params.metric}", lambda: _width_gains(params.metric), dev).clone()
    outlier_pos, outlier_dec, tiles = _outliers(z, sigma, mean, params.outlier_threshold)
    return PackedRun(
        codes=packed,
        base=base,
        per_vector=per_vector,
        bits=bits.to(torch.uint8),
        sigma=sigma,
        mean=mean,
        gains=gains,
        outlier_pos=outlier_pos,
        outlier_dec=outlier_dec,
        outlier_tiles=tiles,
        n=n,
    )


def _check_range(y: torch.Tensor) -> None:
    """The codec's input check: finite, within ``MAX_MAGNITUDE`` (one wait on the device)."""
    if bool((y.abs() <= MAX_MAGNITUDE).all()):
        return
    flat = y.reshape(-1, y.shape[-1])
    bad = (~torch.isfinite(flat)).nonzero()
    if bad.numel():
        row, dim = (int(v) for v in bad[0])
        raise ValueError(f"non-finite value at vector {row % y.shape[1]}, dim {dim}")
    row, dim = (int(v) for v in (flat.abs() > MAX_MAGNITUDE).nonzero()[0])
    raise ValueError(
        f"input magnitude {float(flat[row, dim]):.6g} at vector {row % y.shape[1]}, dim {dim} "
        f"exceeds the supported range (|x| <= {MAX_MAGNITUDE:g})"
    )


def _round_half_away(v: float) -> int:
    """Rust's ``f64::round`` (halves away from zero) of a nonnegative ``v``."""
    whole = int(v)
    return whole + (1 if v - whole >= 0.5 else 0)


def _allocate(variances: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Bits per component ``[K, d]`` int64: the codec's greedy water-filling of ``budget``
    ``[K]`` bits over components of ``variances`` (float32 ``[K, d]``). Every bit it would pick
    removes ``variance_j * (D(b) - D(b + 1))``, falling in ``b``; the greedy takes the largest
    first, the lowest component among equals, until the budget or the positive gains run out:
    the first ``budget`` positive gains of one stable descending sort of them all."""
    k, d = variances.shape
    drops = on_device("drops", _gain_drops, variances.device)
    gains = (variances.double()[:, :, None] * drops).reshape(k, d * MAX_WIDTH)
    order = torch.sort(gains, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    steps = torch.arange(d * MAX_WIDTH, device=variances.device).expand(k, -1)
    rank.scatter_(1, order, steps)
    taken = (rank < budget[:, None]) & (gains > 0)  # (rank < d * MAX_WIDTH always)
    return taken.view(k, d, MAX_WIDTH).sum(dim=-1)


def _pack(
    codes: torch.Tensor, bits: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``codes`` ``[K, n, d]`` (component ``j`` below ``2^bits_j``) packed as the codec packs
    them: per stream-block, vector after vector, each vector's nonzero-width components in
    order, least significant bit first, the block zero-padded to a byte. Returns the packed
    bytes (all blocks, then ``PAD`` zero bytes), where each block's start and its bits per
    vector."""
    k, _, d = codes.shape
    per_vector = bits.sum(dim=1)  # [K]
    size = (per_vector * n + 7) // 8
    base = size.cumsum(0) - size
    total = int(base[-1] + size[-1]) + PAD
    # Bit offsets in int32 where they fit (a chunk's always do): half the bytes of int64.
    at = torch.int32 if total * 8 < 2**31 else torch.int64
    vector = torch.arange(n, device=codes.device, dtype=at)
    start = (
        (base * 8).to(at)[:, None, None]
        + vector[None, :, None] * per_vector.to(at)[:, None, None]
        + (bits.cumsum(dim=1) - bits).to(at)[:, None, :]
    )
    # A code spans at most two bytes; its bits are nobody else's, so adding them is OR-ing.
    # (codes: int32, the caller's to overwrite.)
    word = codes.bitwise_left_shift_((start & 7).to(torch.int32)).reshape(-1)
    byte = start.bitwise_right_shift_(3).reshape(-1)
    out = torch.zeros(total + 1, dtype=torch.int32, device=codes.device)
    out.index_add_(0, byte, word & 0xFF)
    out.index_add_(0, byte.add_(1), word.bitwise_right_shift_(8))
    return out[:total].to(torch.uint8), base, per_vector


def _outliers(
    z: torch.Tensor, sigma: torch.Tensor, mean: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scaled coefficients past ``threshold``, as :class:`PackedRun` holds them: their
    positions in the ``[K, n, d]`` output (ascending, so by tile), their decoded values
    ``mean + float16(z) * sigma`` and where each tile of ``fused_decode.BLOCK_N`` vectors
    starts among them."""
    k, n, d = z.shape
    pos = (z.abs() > threshold).flatten().nonzero().squeeze(1)
    block, comp = pos // (n * d), pos % d
    value = z.flatten()[pos].half().float() * sigma[block, comp].float()
    dec = mean[block, comp].float() + value
    tiles = -(-n // fused_decode.BLOCK_N)
    tile = block * tiles + pos % (n * d) // d // fused_decode.BLOCK_N
    starts = torch.searchsorted(tile, torch.arange(k * tiles + 1, device=z.device))
    return pos, dec, starts
