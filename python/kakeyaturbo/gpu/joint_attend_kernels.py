"""The two Triton kernels of ``fused_joint_attend.py``: a decode step's softmax and value sums
over blocks coded across heads, split over the coded tokens as flash-decoding splits them.

- :func:`partials_kernel`: each program takes a span of the coded tokens for all query rows
  and a slice of the joint coordinates, or one KV head's exact tokens (the sinks, the hot
  window, the new tokens, read where they are held: int8 rows decoded as they load), and
  writes its largest score, its sum of exponentials and its weighted sum; the coded tokens'
  scales may come as their one-byte codes, decoded as they load;
- :func:`combine_kernel`: per KV head, the spans' sums rescaled to the common largest score,
  turned out of the joint coordinates by the head's slice of the value frame, the exact part
  added, divided by the sum of exponentials and written in the layout and dtype attention
  returns.

Inside the kernels an exact run travels as one tuple ``(keys, 3 strides, values, 3 strides,
tokens)`` and token scales as ``(scales or codes, low, step)``: the launch takes them flat.
"""

from __future__ import annotations

from .triton_support import bf16_bits, tl, triton

__all__ = ["combine_kernel", "partials_kernel"]

if triton is not None:

    @triton.jit
    def _scored(
        raw, scaling, softcap, bias_at, ok, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr
    ):
        """Scores as torch makes them: scaled, capped (tanh), biased; -inf outside ``ok``."""
        s = raw * scaling
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): what the interpreter and every GPU have.
            s = (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)) * softcap
        if HAS_BIAS:
            s += tl.load(bias_at, mask=ok, other=0.0)
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _scales(coded, at, blk, ok, CODES: tl.constexpr):
        """Token scales at ``at`` (``blk``: their blocks' low and step) of ``coded = (scales,
        low, step)``: float32 as given, or decoded from their codes as ``fused_decode``'s norm
        kernel does, ``exp2((code - 1) * step + low)``, zero for code 0."""
        scales, low, step = coded
        # One return of one type: Triton compiles every return, the constexpr branch too.
        if CODES:
            code = tl.load(scales + at, mask=ok, other=0).to(tl.float32)
            lg = (code - 1.0) * tl.load(step + blk, mask=ok, other=0.0)
            lg += tl.load(low + blk, mask=ok, other=0.0)
            x = tl.where(code == 0.0, 0.0, tl.exp2(lg))
        else:
            x = tl.load(scales + at, mask=ok, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _values_tile(at, jm, dd, dm, D, INT8: tl.constexpr):
        """Exact values from the rows starting at ``at`` as float32: int8 rows decoded
        (``code * scale``, the scale's bfloat16 bits after the ``D`` codes)."""
        x = tl.load(at[:, None] + dd[None, :], mask=jm[:, None] & dm[None, :], other=0)
        x = x.to(tl.float32)
        if INT8:
            lo = tl.load(at + D, mask=jm, other=0).to(tl.int32) & 0xFF
            hi = tl.load(at + D + 1, mask=jm, other=0).to(tl.int32) & 0xFF
            scale = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
            x = x * scale[:, None]
        return x

    @triton.jit
    def _coded_scores(
        t0,
        hi,
        rm,
        logits,
        key_scales,
        scales_at,
        blocks_at,
        row_bias,
        scaling,
        softcap,
        TOKENS,
        HAS_KEY_SCALES: tl.constexpr,
        KEY_CODES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """The scores of a tile of the span's coded tokens from ``t0`` (below ``hi``) for every
        query row; and the tokens, where their scales and their blocks' are, which are there."""
        t = t0 + tl.arange(0, BLOCK_T)
        # Each token's scale, and its block's low and step for scales as codes.
        at, blk = scales_at + t[None, :], blocks_at + (t // TOKENS)[None, :]
        ok = rm[:, None] & (t < hi)[None, :]
        raw = tl.load(logits + t[None, :], mask=ok, other=0.0)
        if HAS_KEY_SCALES:
            raw *= _scales(key_scales, at, blk, ok, KEY_CODES)
        s = _scored(raw, scaling, softcap, row_bias + t[None, :], ok, HAS_BIAS, HAS_SOFTCAP)
        return s, t, at, blk, ok

    @triton.jit
    def _exact_run(
        state,
        qv,
        rm,
        dd,
        dm,
        run,
        col,
        common,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The online softmax's ``state = (acc, m, total)`` after an exact ``run`` whose scores
        are the bias's columns from ``col``; ``common = (bias_row, b, head, D, scaling,
        softcap)``, the same for every run."""
        acc, m, total = state
        bias_row, b, head, D, scaling, softcap = common
        k, k_sb, k_sh, k_sn, v, v_sb, v_sh, v_sn, n = run
        for n0 in range(0, n, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            jm = j < n
            jj = j.to(tl.int64)
            kt = tl.load(
                k + b * k_sb + head * k_sh + jj[:, None] * k_sn + dd[None, :],
                mask=jm[:, None] & dm[None, :],
                other=0.0,
            ).to(tl.float32)
            raw = tl.dot(qv, tl.trans(kt), input_precision="ieee")
            ok = rm[:, None] & jm[None, :]
            s = _scored(
                raw, scaling, softcap, bias_row + col + j[None, :], ok, HAS_BIAS, HAS_SOFTCAP
            )
            top = tl.maximum(m, tl.max(s, axis=1))
            base = tl.where(top == float("-inf"), 0.0, top)
            p = tl.exp(s - base[:, None])
            alpha = tl.exp(m - base)
            total = total * alpha + tl.sum(p, axis=1)
            at = v + b * v_sb + head * v_sh + jj * v_sn
            vt = _values_tile(at, jm, dd, dm, D, INT8)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m = top
        return acc, m, total

    @triton.jit
    def _span_partials(
        logits,
        key_scales,
        values,
        value_scales,
        bias_args,
        partials,
        b,
        pid,
        sizes,
        scaling,
        softcap,
        HAS_KEY_SCALES: tl.constexpr,
        KEY_CODES: tl.constexpr,
        HAS_VALUE_SCALES: tl.constexpr,
        VALUE_CODES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        """A partials program over a span of the coded tokens, for all query rows and a slice
        of the joint coordinates."""
        T, C, H, ROWS, SPAN, SPANS, SLICES, TOKENS = sizes
        bias, bias_sb, bias_sq = bias_args
        m_c, l_c, acc_c = partials
        Q = H * ROWS
        span = pid // SLICES
        cc = (pid % SLICES) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cc < C
        r = tl.arange(0, BLOCK_Q)
        rm = r < Q
        head = (r // ROWS).to(tl.int64)
        lo = span * SPAN
        hi = tl.minimum(lo + SPAN, T)
        row_logits = logits + (b * Q + r)[:, None] * T
        row_bias = bias + b * bias_sb + r[:, None] * bias_sq
        scales_at = (b * H + head)[:, None] * T
        blocks_at = (b * H + head)[:, None] * (T // TOKENS)
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        for t0 in range(lo, hi, BLOCK_T):  # the span's largest score
            s, _t, _at, _blk, _ok = _coded_scores(
                t0, hi, rm, row_logits, key_scales, scales_at, blocks_at, row_bias, scaling,
                softcap, TOKENS, HAS_KEY_SCALES, KEY_CODES, HAS_BIAS, HAS_SOFTCAP, BLOCK_T,
            )  # fmt: skip
            m = tl.maximum(m, tl.max(s, axis=1))
        base = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_C], dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_T):  # its exponentials and weighted sums
            s, t, at, blk, ok = _coded_scores(
                t0, hi, rm, row_logits, key_scales, scales_at, blocks_at, row_bias, scaling,
                softcap, TOKENS, HAS_KEY_SCALES, KEY_CODES, HAS_BIAS, HAS_SOFTCAP, BLOCK_T,
            )  # fmt: skip
            p = tl.exp(s - base[:, None])
            total += tl.sum(p, axis=1)
            if HAS_VALUE_SCALES:
                p *= _scales(value_scales, at, blk, ok, VALUE_CODES)
            yv = tl.load(
                values + (b * T + t.to(tl.int64))[:, None] * C + cc[None, :],
                mask=(t < hi)[:, None] & cm[None, :],
                other=0.0,
            )
            acc += tl.dot(p, yv, input_precision="ieee")
        at = (b * SPANS + span) * Q + r
        tl.store(
            acc_c + at.to(tl.int64)[:, None] * C + cc[None, :],
            acc,
            mask=rm[:, None] & cm[None, :],
        )
        if pid % SLICES == 0:
            tl.store(m_c + at, m, mask=rm)
            tl.store(l_c + at, total, mask=rm)

    @triton.jit
    def _exact_partials(
        q,
        q_sb,
        q_sh,
        q_sr,
        run0,
        run1,
        run2,
        bias_args,
        partials,
        b,
        head,
        T,
        H,
        ROWS,
        D,
        scaling,
        softcap,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8_0: tl.constexpr,
        INT8_1: tl.constexpr,
        INT8_2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """A partials program over one KV head's exact tokens: the sinks, the hot window, the
        new tokens (three runs, each a tuple as :func:`_exact_run` reads it)."""
        bias, bias_sb, bias_sq = bias_args
        m_e, l_e, acc_e = partials
        rr = tl.arange(0, BLOCK_R)
        rm = rr < ROWS
        dd = tl.arange(0, BLOCK_D)
        dm = dd < D
        qv = tl.load(
            q + b * q_sb + head * q_sh + rr[:, None] * q_sr + dd[None, :],
            mask=rm[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)
        bias_row = bias + b * bias_sb + (head * ROWS + rr)[:, None] * bias_sq
        state = (
            tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32),
            tl.full([BLOCK_R], float("-inf"), tl.float32),
            tl.zeros([BLOCK_R], dtype=tl.float32),
        )
        common = (bias_row, b, head, D, scaling, softcap)
        state = _exact_run(
            state, qv, rm, dd, dm, run0, T, common, HAS_BIAS, HAS_SOFTCAP, INT8_0, BLOCK_N
        )
        col = T + run0[8]
        state = _exact_run(
            state, qv, rm, dd, dm, run1, col, common, HAS_BIAS, HAS_SOFTCAP, INT8_1, BLOCK_N
        )
        col += run1[8]
        state = _exact_run(
            state, qv, rm, dd, dm, run2, col, common, HAS_BIAS, HAS_SOFTCAP, INT8_2, BLOCK_N
        )
        acc, m, total = state
        at = (b * H + head) * ROWS + rr
        tl.store(acc_e + at[:, None] * D + dd[None, :], acc, mask=rm[:, None] & dm[None, :])
        tl.store(m_e + at, m, mask=rm)
        tl.store(l_e + at, total, mask=rm)

    @triton.jit
    def partials_kernel(
        logits,  # float32 [B, Q, T]: the coded keys' logits (Q = H * ROWS query rows)
        key_scales,  # float32 [B, H, T], or uint8 codes (KEY_CODES)
        key_low,  # float32 [B, H, T / TOKENS]: with codes, each block's log2 low and step
        key_step,
        values,  # float32 [B, T, C]: the coded values' joint coordinates
        value_scales,  # as the key scales
        value_low,
        value_step,
        q,  # [B, H, ROWS, D] the queries (exact keys' logits)
        q_sb,
        q_sh,
        q_sr,
        k0,  # the first exact run's keys [B, H, n0, D] and their batch, head, token strides,
        k0_sb,
        k0_sh,
        k0_sn,
        v0,  # its values [B, H, n0, D] (or int8 rows [B, H, n0, D + 2]) and theirs,
        v0_sb,
        v0_sh,
        v0_sn,
        n0,  # its tokens; likewise the second and third runs
        k1,
        k1_sb,
        k1_sh,
        k1_sn,
        v1,
        v1_sb,
        v1_sh,
        v1_sn,
        n1,
        k2,
        k2_sb,
        k2_sh,
        k2_sn,
        v2,
        v2_sb,
        v2_sh,
        v2_sn,
        n2,
        bias,  # float32 [B or 1, 1, Q, T + n0 + n1 + n2]
        bias_sb,
        bias_sq,
        m_c,  # float32 [B, SPANS, Q]: each span's largest score,
        l_c,  # its sum of exponentials,
        acc_c,  # [B, SPANS, Q, C] and its weighted sum of the coordinates
        m_e,  # float32 [B, H, ROWS]: the same of each head's exact tokens
        l_e,
        acc_e,  # [B, H, ROWS, D]
        T,
        C,
        H,
        ROWS,
        D,
        SPAN,
        SPANS,
        SLICES,
        scaling,
        softcap,
        TOKENS,  # tokens per block of the scale codes
        HAS_KEY_SCALES: tl.constexpr,
        HAS_VALUE_SCALES: tl.constexpr,
        KEY_CODES: tl.constexpr,
        VALUE_CODES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        INT8_0: tl.constexpr,
        INT8_1: tl.constexpr,
        INT8_2: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        bias_args = (bias, bias_sb, bias_sq)
        # Each branch is a function of its own: Triton wants a name assigned in both branches
        # of a runtime `if` to have one type, and the two programs' tiles differ.
        if pid < SPANS * SLICES:  # a span of the coded tokens, a slice of the coordinates
            _span_partials(
                logits, (key_scales, key_low, key_step), values,
                (value_scales, value_low, value_step), bias_args, (m_c, l_c, acc_c), b, pid,
                (T, C, H, ROWS, SPAN, SPANS, SLICES, TOKENS), scaling, softcap, HAS_KEY_SCALES,
                KEY_CODES, HAS_VALUE_SCALES, VALUE_CODES, HAS_BIAS, HAS_SOFTCAP, BLOCK_T,
                BLOCK_C, BLOCK_Q,
            )  # fmt: skip
        else:  # one KV head's exact tokens
            _exact_partials(
                q, q_sb, q_sh, q_sr, (k0, k0_sb, k0_sh, k0_sn, v0, v0_sb, v0_sh, v0_sn, n0),
                (k1, k1_sb, k1_sh, k1_sn, v1, v1_sb, v1_sh, v1_sn, n1),
                (k2, k2_sb, k2_sh, k2_sn, v2, v2_sb, v2_sh, v2_sn, n2), bias_args,
                (m_e, l_e, acc_e), b, (pid - SPANS * SLICES).to(tl.int64), T, H, ROWS, D,
                scaling, softcap, HAS_BIAS, HAS_SOFTCAP, INT8_0, INT8_1, INT8_2, BLOCK_N,
                BLOCK_R, BLOCK_D,
            )  # fmt: skip

    @triton.jit
    def _span_weight(m_c, at, rm, base):
        """How much a span's partial sums weigh at the common largest score ``base``."""
        return tl.exp(tl.load(m_c + at, mask=rm, other=float("-inf")) - base)

    @triton.jit
    def combine_kernel(
        m_e,  # partials_kernel's: each head's exact tokens' largest score, sum, weighted sum,
        l_e,
        acc_e,
        m_c,  # and each span's of the coded tokens
        l_c,
        acc_c,
        frames,  # float32 [H, C, D]: each head's slice of the joint value frame
        out,  # [B, TQ, H * G, D] attention's output, in its dtype
        SPANS,
        C,
        H,
        ROWS,
        D,
        TQ,
        OUT_BF16: tl.constexpr,  # out is bfloat16's bits as int16
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        rm = rr < ROWS
        dd = tl.arange(0, BLOCK_D)
        dm = dd < D
        Q = H * ROWS
        qr = head * ROWS + rr  # the head's rows among all query rows
        exact = (b * H + head) * ROWS + rr
        top = tl.load(m_e + exact, mask=rm, other=float("-inf"))
        for span in range(SPANS):
            top = tl.maximum(
                top, tl.load(m_c + (b * SPANS + span) * Q + qr, mask=rm, other=float("-inf"))
            )
        base = tl.where(top == float("-inf"), 0.0, top)
        w_e = _span_weight(m_e, exact, rm, base)
        total = w_e * tl.load(l_e + exact, mask=rm, other=0.0)
        for span in range(SPANS):
            at = (b * SPANS + span) * Q + qr
            total += _span_weight(m_c, at, rm, base) * tl.load(l_c + at, mask=rm, other=0.0)
        res = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            sums = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
            for span in range(SPANS):
                at = (b * SPANS + span) * Q + qr
                part = tl.load(
                    acc_c + at[:, None] * C + cc[None, :],
                    mask=rm[:, None] & (cc < C)[None, :],
                    other=0.0,
                )
                sums += _span_weight(m_c, at, rm, base)[:, None] * part
            f = tl.load(
                frames + (head * C + cc.to(tl.int64))[:, None] * D + dd[None, :],
                mask=(cc < C)[:, None] & dm[None, :],
                other=0.0,
            )
            res += tl.dot(sums, f, input_precision="ieee")
        ex = tl.load(
            acc_e + exact[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :], other=0.0
        )
        res += w_e[:, None] * ex
        res = tl.where(total[:, None] > 0.0, res / tl.where(total > 0.0, total, 1.0)[:, None], 0.0)
        # Row j * TQ + t is query head head * G + j at token t.
        g = ROWS // TQ
        at = ((b * TQ + rr % TQ) * (H * g) + head * g + rr // TQ) * D
        if OUT_BF16:  # rounded by the bits, as torch rounds (the interpreter truncates)
            res = bf16_bits(res).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(
            out + at[:, None] + dd[None, :],
            res.to(out.dtype.element_ty),
            mask=rm[:, None] & dm[None, :],
        )

else:
    partials_kernel = None
    combine_kernel = None
