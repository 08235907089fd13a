"""The one round trip behind every front-end: ``KakeyaCache``, the evaluation's ``kakeya``
method and the vLLM hooks all code K/V through :class:`Pipeline` and keep no copy of it.

One layer's keys or values ``x`` ``[batch, kv_heads, tokens, head_dim]`` go through::

    keys: unrotate RoPE (pre-RoPE recipes, at the tokens' positions)
    -> coding frame      calibration bundle's (query-aware whitened PCA for keys, PCA for
                         values; nothing stored) or a PCA frame per (layer, head) fitted on the
                         first tokens coded and held once as float16 (counted; none for a
                         sequence shorter than 4 tokens per dimension, where it cannot pay)
    -> token norms       (recipe's choice per stream, dropped for a layer whose tokens put most
                         of their energy in one direction: ``unit_tokens.py``; decoders read
                         the choice from the blocks) each token is scaled to unit norm and
                         its norm held in one byte (``norm_codes.py``: log-spaced over the
                         stream's range, at most 1.1% off), so the codec's error is relative
                         per token (small-norm tokens that draw much attention keep their
                         precision) and each decoded token is given its norm back (no shrinkage)
    -> across heads      (recipe's ``joint_heads``, from a bundle fitted with --joint-heads)
                         the heads' coordinates side by side, rotated by the bundle's frame
                         across them: one stream per (block, batch row) of heads x head_dim;
                         streams with token norms store each head's scale instead (its norm
                         over its decoded norm, known once coded), so a decoder, or attention
                         over the codes, never needs a head's decoded norm
    -> codec             one stream per (block, batch row, kv head): water-filling over the
                         frame's components at the layer's bits per value; a stored prefix's
                         newest ``recent_tokens`` form blocks of their own at ``recent_bits`` more
    <- and back in reverse order on decode.

Blocks are ``recipe.block_size`` tokens; a span that is not a whole number of blocks ends in a
shorter block (the evaluation's prefixes; the cache only ever codes whole blocks).

**Attention sinks** (one meaning everywhere: the first ``sink_tokens`` real tokens of each
sequence are held exact, beside the streams, by the caller). The caller passes their mask; in
the coded block they are replaced by the mean of the block's other tokens, so their large,
unusual vectors spend neither the frame nor the quantiser's range, and the caller writes the
exact values over their decoded slots. The recent window is the caller's: it is never coded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch

from . import codec as _codec
from ._runs import equal_runs
from .attend import AttendArgs, AttentionOverCodes
from .coded_block import STREAMS, BlockRun, CodedBlock, norm_code_lists, stream_major
from .frames import Frames, fits_frame
from .gpu import device_encode
from .gpu.device_decode import DeviceBlocks
from .norm_codes import StackedNorms, decode_norms, encode_norms
from .recipes import MAX_BITS, Recipe
from .unit_tokens import TokenNormChoice, holds_norms

__all__ = ["AttendArgs", "BlockRun", "CodedBlock", "Pipeline", "STREAMS"]


class Pipeline(Frames, AttentionOverCodes):
    """Codes one model's K/V with one recipe (and, optionally, its calibration bundle).

    Its coding frames are :class:`~kakeyaturbo.frames.Frames`' (``frames.py``) and attention
    over its codes is :class:`~kakeyaturbo.attend.AttentionOverCodes`' (``attend.py``).

    Args:
        recipe: what to do (:mod:`kakeyaturbo.recipes`).
        calibration: a :class:`~kakeyaturbo.calibration.Calibration` whose frames replace the
            self-fitted ones (keys must then be pre-RoPE).
        rope: ``rope(layer)`` -> the layer's :class:`~kakeyaturbo.hf.rope.RotarySpec`, needed
            when keys arrive post-RoPE with positions (pre-RoPE recipes).
    """

    def __init__(
        self,
        recipe: Recipe,
        calibration: Any = None,
        rope: Optional[Callable[[int], Any]] = None,
    ) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a kakeyaturbo.recipes.Recipe, got {type(recipe)}")
        self.recipe = recipe
        self.calibration = calibration
        self._rope = rope
        self._transforms = None
        if calibration is not None:
            from .calibration import KVTransforms

            self._transforms = KVTransforms(calibration, whiten=recipe.whiten)
        if recipe.joint_heads:
            if calibration is None or not calibration.joint_heads:
                raise ValueError(
                    "joint_heads needs a calibration bundle with frames across heads "
                    "(kakeyaturbo calibrate --joint-heads)"
                )
            if recipe.joint("k") and not recipe.whiten:
                raise ValueError("joint_heads: the frames across heads are fitted on whitened keys")
        # (layer, stream) -> [H, D, D] self-fitted frame, fitted on the first tokens coded.
        self._frames: dict[tuple[int, str], torch.Tensor] = {}
        # Whether each (layer, stream) is coded with token norms, decided on its first tokens.
        self.token_norms = TokenNormChoice(recipe)

    def fresh(self) -> Pipeline:
        """The same recipe and calibration with no self-fitted frame yet (an independent
        sequence: each evaluation passage, each vLLM prompt)."""
        return Pipeline(self.recipe, self.calibration, self._rope)

    # ---- the round trip --------------------------------------------------------------------

    def encode(
        self,
        x: torch.Tensor,
        layer: int,
        stream: str,
        positions: Optional[torch.Tensor] = None,
        sinks: Optional[torch.Tensor] = None,
        newer: Optional[int] = None,
    ) -> list[CodedBlock]:
        """Code ``x`` ``[B, H, T, D]`` into blocks of ``recipe.block_size`` tokens.

        ``positions`` ([B, T] int) are the keys' RoPE positions: given for post-RoPE keys of a
        pre-RoPE recipe, they are unrotated first. Keys that are already pre-RoPE (vLLM's
        pre-RoPE hook) and values pass None. ``sinks`` ([B, T] bool): tokens the caller holds
        exact (coded as their block's mean). ``newer``: how many tokens of the sequence are
        newer than the span's last one (None: unknown); the span's tokens among the recipe's
        ``recent_tokens`` newest are coded apart at ``recent_bits`` more bits."""
        _check(x, stream)
        one = lambda t: None if t is None else t.cpu()[None]  # noqa: E731 (as one layer of many)
        if sinks is not None and not bool(sinks.any()):
            sinks = None
        self._decide_norms(x, layer, stream, positions, sinks)
        x = x.detach().float().cpu()[None]
        y, norms = self._prepared(x, [layer], stream, one(positions), one(sinks))
        norms = None if norms is None else norms[0]
        blocks = self.code_frame(y[0], layer, stream, norms, newer)
        if norms is not None and self.recipe.joint(stream):
            self._store_scales(blocks, layer, stream, norms)
        return blocks

    def encode_on_device(
        self, x: torch.Tensor, layer: int, stream: str, **where: Any
    ) -> DeviceBlocks:
        """:meth:`encode` of whole blocks, done on ``x``'s device and held there: what
        ``DeviceBlocks.of(encode(x, ...), x.device)`` holds, without the round trip through the
        host (``device_encode.py``; the same blocks but for float rounding in the steps before
        the codec, which a GPU orders its own way). For a cache whose blocks live on the
        model's device (``hf/layer.py``); its recipe must be one the device decoder reads.
        ``where``: :meth:`encode`'s ``positions`` and ``sinks``, by keyword."""
        if set(where) - {"positions", "sinks"}:
            raise TypeError(f"encode_on_device takes positions and sinks, got {sorted(where)}")
        span = (x, layer, where.get("positions"), where.get("sinks"))
        return self.encode_layers_on_device([span], stream)[0]

    def encode_layers_on_device(self, spans: Sequence[tuple], stream: str) -> list[DeviceBlocks]:
        """:meth:`encode_on_device` of several layers' spans ``(x, layer, positions, sinks)``
        at once (a cache flushing its layers together): spans alike (shape, device, RoPE,
        frame kind, codec parameters but for each layer's rate) are coded by one set of ops
        over all of them, each layer's blocks the same as coded alone. On a GPU what sets a
        flush's time is how many small ops the host queues, not their size."""
        bs = self.recipe.block_size
        groups: dict[tuple, list[int]] = {}
        for i, (x, layer, positions, sinks) in enumerate(spans):
            _check(x, stream)
            if x.shape[2] == 0 or x.shape[2] % bs:
                raise ValueError(
                    f"encode_on_device codes whole blocks of {bs} tokens, got {x.shape[2]}"
                )
            self._decide_norms(x, layer, stream, positions, sinks)
            groups.setdefault(self._alike(x, layer, stream, positions), []).append(i)
        out: list = [None] * len(spans)
        for members in groups.values():
            coded = self._encode_alike([spans[i] for i in members], stream)
            for i, held in zip(members, coded):
                out[i] = held
        return out

    def _alike(self, x: torch.Tensor, layer: int, stream: str, positions) -> tuple:
        """What layers' spans coded together share."""
        rope = None
        if positions is not None and stream == "k" and self.recipe.pre_rope:
            spec = self._rope_for(layer)
            rope = (spec.rot_dim, spec.adjacent_pairs, spec.inv_freq.numpy().tobytes())
        identity = False  # the self-fitted frame is none (a short sequence's)
        if self._transforms is None:
            frame = self._frames.get((layer, stream))
            identity = not fits_frame(x) if frame is None else not frame.numel()
        params = self.recipe.params(layer, stream).replace(bits_per_value=1.0)
        norms = self.token_norms.of(layer, stream)
        params = repr(params.to_dict())
        return (tuple(x.shape), x.dtype, str(x.device), rope, identity, norms, params)

    def _encode_alike(self, spans: list[tuple], stream: str) -> list[DeviceBlocks]:
        bs, count = self.recipe.block_size, spans[0][0].shape[2] // self.recipe.block_size
        layers = [layer for _, layer, _, _ in spans]
        n = len(spans)
        stack = lambda ts: ts[0][None] if n == 1 else torch.stack(ts)  # noqa: E731
        b, h, t, _ = spans[0][0].shape
        positions = None
        if spans[0][2] is not None:
            positions = stack([s[2] for s in spans]).to(spans[0][0].device)
        masks = [m for _, _, _, m in spans]
        sinks = None
        if any(m is not None and bool(m.any()) for m in masks):
            none = torch.zeros(b, t, dtype=torch.bool)
            sinks = stack([none if m is None else m.cpu().bool() for m in masks])
        # (Their stack held by no name here: each step's input is freed once it is used.)
        y, norms = self._prepared(
            stack([s[0] for s in spans]).detach().float(), layers, stream, positions, sinks
        )
        per = b * y.shape[2] * count  # each layer's stream-blocks: stream-major, as DeviceBlocks
        params = [self.recipe.params(layer, stream) for layer in layers]
        try:
            runs = device_encode.encode_runs(
                y.reshape(n * per, bs, y.shape[-1]),
                [p for p in params for _ in range(per)],
                [per] * n,
            )
        except ValueError as exc:
            raise ValueError(f"layers {layers} {stream}: {exc}") from None
        del y
        held = [DeviceBlocks([(r, count)], per // count, None, t) for r in runs]
        if norms is not None:
            divisor = None  # across heads, each head's scale: over its decoded unit vector's norm
            if self.recipe.joint(stream):
                coded = torch.cat([r.decode() for r in runs]) if n > 1 else runs[0].decode()
                divisor = self._head_norms(coded.view(n, b, t, -1), layers, stream, h)
                divisor = divisor.reshape(n * b, h, t)
            stacked = StackedNorms.encoded(norms.reshape(n * b, h, t), bs, divisor)
            for i, one in enumerate(stacked.split([b] * n)):
                held[i].norms = one
        return held

    def _prepared(self, x, layers, stream, positions, sinks):
        """``x`` ``[L, B, H, T, D]`` float32, the spans of ``layers`` (``positions`` and
        ``sinks`` ``[L, B, T]`` or None) -> (their coding-frame coordinates ``[L, B, S, T, C]``,
        the codec's input; the tokens' norms ``[L, B, H, T]`` float16 where the stream is coded
        with them, else None), on ``x``'s device, by one set of ops for them all."""
        n, b, h, t, d = x.shape
        if positions is not None and stream == "k" and self.recipe.pre_rope:
            flat = positions.to(x.device).reshape(n * b, t)
            x = self._rope_for(layers[0]).unrotate(x.reshape(n * b, h, t, d), flat).view(x.shape)
        if sinks is not None:
            flat = sinks.reshape(n * b, t)
            x = _neutralise(x.reshape(n * b, h, t, d), flat, self.recipe.block_size).view(x.shape)
        y = self._into_frames(x, layers, stream)
        del x  # (each step's input is freed once the next is made: the flush's peak)
        norms = None
        # (Alike layers share the choice: _alike.)
        if self.token_norms.of(layers[0], stream):
            full = y.norm(dim=-1)
            if float(full.amax()) > torch.finfo(torch.float16).max:  # (NaN: the codec's error)
                top = full.amax(dim=(1, 2, 3))
                i = int(top.argmax())
                raise ValueError(
                    f"layer {layers[i]} {stream}: a token's norm {float(top[i]):.4g} exceeds "
                    "float16's range (65504), where token norms are stored; code this stream "
                    f"without token norms ({stream}_token_norms=False)"
                )
            norms = full.half()
            # The clamp keeps zero vectors zero (their stored norm is 0) instead of NaN.
            # (Divided in float32: float16 operands are converted exactly.)
            y = y / norms.clamp_min(torch.finfo(torch.float16).tiny)[..., None]
        if not self.recipe.joint(stream):
            return y, norms
        joint = self._joints(layers, stream, y.device)[:, None]
        heads = y.permute(0, 1, 3, 2, 4).reshape(n, b, t, h * d)  # side by side: a copy
        del y
        return (heads @ joint)[:, :, None], norms

    def _store_scales(self, blocks: list[CodedBlock], layer: int, stream: str, norms) -> None:
        """Replace the blocks' token norms ``[B, H, T]`` by each head's scale
        (:meth:`_head_scales`)."""
        coded = _coded(blocks, norms.shape[0])[:, 0]
        scale = self._head_scales(coded[None], [layer], stream, norms[None])[0]
        start = 0
        for blk in blocks:
            blk.norms = encode_norms(scale[:, :, start : start + blk.tokens])
            start += blk.tokens

    def code_frame(
        self,
        y: torch.Tensor,
        layer: int,
        stream: str,
        norms: Optional[torch.Tensor] = None,
        newer: Optional[int] = None,
    ) -> list[CodedBlock]:
        """The codec's half of :meth:`encode`: ``y`` ``[B, S, T, C]``, already in the coding
        frame, coded with ``layer``'s ``stream`` parameters in blocks, the span's newest tokens
        apart; ``norms`` ``[B, H, T]`` (the tokens' norms where ``y`` holds unit vectors) are
        stored with the blocks."""
        bs, t = self.recipe.block_size, y.shape[2]
        params = self.recipe.params(layer, stream)
        recent = 0
        if newer is not None and self.recipe.recent_bits > 0:
            recent = min(max(self.recipe.recent_tokens - newer, 0), t)
        blocks = _code_blocks(y[:, :, : t - recent], norms, 0, params, bs, layer, stream)
        if recent:
            bits = min(params.bits_per_value + self.recipe.recent_bits, MAX_BITS)
            hi = params.replace(bits_per_value=bits)
            blocks += _code_blocks(y[:, :, t - recent :], norms, t - recent, hi, bs, layer, stream)
        return blocks

    def decode(
        self,
        blocks: list[CodedBlock] | DeviceBlocks,
        layer: int,
        stream: str,
        rows: int,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``[rows, H, sum(tokens), D]`` float32 on the CPU, or on
        the device of :class:`~kakeyaturbo.device_decode.DeviceBlocks` (keys rotated back to
        ``positions`` when given)."""
        if self.recipe.joint(stream):
            y = self._decode_joint(blocks, layer, stream, rows)
        else:
            y = self.decode_frame(blocks, stream, rows)
        return self._from_frame(y, layer, stream, positions)

    def _decode_joint(
        self,
        blocks: list[CodedBlock] | DeviceBlocks,
        layer: int,
        stream: str,
        rows: int,
    ) -> torch.Tensor:
        """Blocks coded across heads -> each head's coding-frame coordinates ``[rows, H, T, D]``
        (times its stored scale, for streams with token norms)."""
        heads = self._transforms.matrix(layer, stream, "inv").shape[0]  # type: ignore[union-attr]
        y = self._heads(_coded(blocks, rows)[:, 0][None], [layer], stream, heads)[0]
        if holds_norms(blocks):
            y = y * _coded_norms(blocks)[..., None]  # as the device decoder scales them
        return y

    def joint_scales(self, blocks: list[CodedBlock] | BlockRun | DeviceBlocks) -> torch.Tensor:
        """Each head's stored scale ``[rows, H, T]`` of blocks coded across heads with token
        norms: head ``h`` of a token is its decoded coordinates' slice times this. Blocks on
        the host are decoded by the codec in one call, as its attention kernels decode norms
        (torch takes a few ops per block); an ulp apart from
        :meth:`decode`'s, which the device decoder matches bit for bit."""
        if isinstance(blocks, DeviceBlocks):
            return _coded_norms(blocks)
        parts = blocks.blocks if isinstance(blocks, BlockRun) else blocks
        rows, heads, _ = parts[0].norms.codes.shape  # type: ignore[union-attr]
        codes = blocks.scales if isinstance(blocks, BlockRun) else None
        codes = norm_code_lists(parts) if codes is None else codes
        return torch.from_numpy(_codec.decode_norm_codes(codes, rows * heads)).view(rows, heads, -1)

    def joint_codes(self, blocks: list[CodedBlock] | DeviceBlocks, rows: int) -> torch.Tensor:
        """The codec's output for blocks coded across heads, ``[rows, T, H*D]`` float32 where
        the blocks are held: :meth:`joint_frame` takes it to the heads (times
        :meth:`joint_scales`, for streams with token norms)."""
        return _coded(blocks, rows)[:, 0]

    def decode_frame(self, blocks: list[CodedBlock], stream: str, rows: int) -> torch.Tensor:
        """:meth:`decode` up to the coding frame: ``y`` ``[rows, H, sum(tokens), D]`` float32,
        with ``x = y @ frame_inverse(layer, stream)`` (then RoPE for keys)."""
        y, scale = self.decode_codes(blocks, stream, rows)
        if scale is not None:
            y.mul_(scale[..., None])  # y is this call's own buffer
        return y

    def decode_codes(
        self, blocks: list[CodedBlock] | DeviceBlocks, stream: str, rows: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The codec's output ``y`` ``[rows, H, T, D]`` and, for streams coded with token
        norms, each token's scale ``[rows, H, T]`` (its stored norm over ``|y|``), which
        :meth:`decode_frame` applies. Attention over the codes folds the scale into the
        attention weights instead of scaling every value. On the CPU, or on the device of
        :class:`~kakeyaturbo.device_decode.DeviceBlocks`."""
        y = _coded(blocks, rows)
        if not holds_norms(blocks):
            return y, None
        norms = _coded_norms(blocks)
        if norms.shape[1] != y.shape[1]:
            raise ValueError("blocks coded across heads (joint_heads): decode them with decode()")
        # Each token gets its stored norm back: the quantiser's reconstruction shrinks
        # towards the mean, and shrunken keys flatten every softmax (a systematic perplexity
        # rise that a small MSE hides).
        return y, norms / y.norm(dim=-1).clamp_min(1e-12)

    def roundtrip(
        self, x: torch.Tensor, layer: int, stream: str, **where: Any
    ) -> tuple[torch.Tensor, list[CodedBlock]]:
        """Encode then decode ``x`` (``where``: :meth:`encode`'s ``positions``, ``sinks`` and
        ``newer``, by keyword): (reconstruction in ``x``'s dtype and device, with the
        ``sinks`` written back exact; the blocks). Frame bytes are the caller's to count
        (:meth:`frame_bytes`): they are held once per sequence, not per call."""
        positions, sinks = where.get("positions"), where.get("sinks")
        blocks = self.encode(x, layer, stream, **where)
        y = self.decode(blocks, layer, stream, x.shape[0], positions)
        y = y.to(device=x.device, dtype=x.dtype)
        if sinks is not None:
            y = torch.where(sinks.to(y.device)[:, None, :, None], x, y)
        return y, blocks


def _check(x: Any, stream: str) -> None:
    if stream not in STREAMS:
        raise ValueError(f"stream must be 'k' or 'v', got {stream!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected [batch, kv_heads, tokens, head_dim] tensor, got {got}")


def _neutralise(x: torch.Tensor, sinks: torch.Tensor, bs: int) -> torch.Tensor:
    """``x`` ``[R, H, T, D]`` with each sink token (``sinks`` ``[R, T]`` bool, read on the host)
    replaced by the mean of the other tokens of its block (of ``bs`` tokens from the first).
    Only the blocks holding a sink are read, planned on the host: six ops on ``x``'s device per
    block and one copy of ``x`` (a prompt's sinks sit in its first block), where every block
    took ten ops and two copies."""
    held = sinks.cpu().numpy().astype(bool)
    t = x.shape[2]
    starts = sorted({i - i % bs for i in np.flatnonzero(held.any(0)).tolist()})
    pieces, done = [], 0
    for lo in starts:
        hi = min(lo + bs, t)
        keep = ~held[:, lo:hi]
        count = np.maximum(keep.sum(1, keepdims=True), 1).repeat(hi - lo, 1)
        plan = torch.from_numpy(np.stack((keep, count, ~keep)).astype(np.float32))
        keep_, count_, sink = plan.to(x.device)[:, :, None, :, None]  # one copy over
        seg = x[:, :, lo:hi]
        mean = (seg * keep_).sum(2, keepdim=True) / count_[:, :, :1]
        # Weights of 0 and 1 select exactly (lerp's two formulas): one op, not a mask and a where.
        pieces += [x[:, :, done:lo], torch.lerp(seg, mean, sink)]
        done = hi
    if not pieces:
        return x
    return torch.cat([*pieces, x[:, :, done:]], dim=2)


def _code_blocks(y, norms, start, params, bs, layer, stream) -> list[CodedBlock]:
    """Code ``y`` [B, H, T, D] (tokens ``start``.. of the span) as whole blocks of ``bs``, then
    a shorter last one; whole blocks go to the codec in one parallel call."""
    b, h, t, d = y.shape
    blocks: list[CodedBlock] = []

    def norms_of(lo: int, hi: int):
        return None if norms is None else encode_norms(norms[:, :, start + lo : start + hi])

    whole = t // bs
    if whole:
        streams = y[:, :, : whole * bs].reshape(b, h, whole, bs, d).permute(2, 0, 1, 3, 4)
        encs = _encode(streams.reshape(whole * b * h, bs, d), params, layer, stream)
        per = b * h
        for j in range(whole):
            encs_j = encs[j * per : (j + 1) * per]
            blocks.append(CodedBlock(encs_j, norms_of(j * bs, (j + 1) * bs), bs))
    rest = t - whole * bs
    if rest:
        tail = y[:, :, whole * bs :].reshape(b * h, rest, d)
        encs = _encode(tail, params, layer, stream)
        blocks.append(CodedBlock(encs, norms_of(whole * bs, t), rest))
    return blocks


def _encode(streams: torch.Tensor, params, layer: int, stream: str) -> list:
    try:
        return _codec.encode_batch(streams.contiguous(), params)
    except ValueError as exc:
        raise ValueError(f"layer {layer} {stream}: {exc}") from None


def decode_blocks(blocks: Sequence[CodedBlock], rows: int) -> torch.Tensor:
    """The codec's output for consecutive blocks: ``[rows, S, sum(tokens), C]`` float32, in the
    coding frame, before any token-norm scale."""
    if not blocks:
        raise ValueError("decode: no blocks")
    # Equal-length blocks decode in one parallel call.
    parts = [_decode_run(run, rows) for run in equal_runs(blocks, lambda blk: blk.tokens)]
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def _coded(blocks: Sequence[CodedBlock] | DeviceBlocks, rows: int) -> torch.Tensor:
    """:func:`decode_blocks`, or the same decoded on the device that holds ``blocks``."""
    if isinstance(blocks, DeviceBlocks):
        return blocks.decode(rows)
    return decode_blocks(blocks, rows)


def _coded_norms(blocks: Sequence[CodedBlock] | BlockRun | DeviceBlocks) -> torch.Tensor:
    """The token norms ``[rows, heads, T]`` of blocks coded with them, where they are held."""
    if isinstance(blocks, DeviceBlocks):
        return blocks.norms.decode()  # type: ignore[union-attr]
    if isinstance(blocks, BlockRun):
        blocks = blocks.blocks
    return decode_norms([blk.norms for blk in blocks])  # type: ignore[misc]


def _decode_run(blocks: Sequence[CodedBlock], rows: int) -> torch.Tensor:
    """Decode equally long blocks in one call -> [rows, H, n_blocks * tokens, D]: the streams
    are handed over stream-major (each (row, head) stream's blocks in token order), so the
    decoded array is already in that layout and needs no concatenation."""
    encs, streams = stream_major(blocks)
    out = _codec.decode_batch(encs)
    y = torch.from_numpy(np.ascontiguousarray(out)) if isinstance(out, np.ndarray) else out
    n, t, d = len(blocks), blocks[0].tokens, y.shape[-1]
    return y.float().reshape(rows, streams // rows, n * t, d)
