"""Attention over the codes: the codec's kernels compute a decode step's attention logits and
value sums straight from coded blocks, with no decoded copy of the keys or values
(``codec.coded_key_logits``, ``coded_value_sums``, ``coded_attend``). The coding itself is
the pipeline's (``pipeline.py``); this is the reading side :class:`~kakeyaturbo.pipeline.
Pipeline` inherits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from . import codec as _codec
from ._arrays import bf16_bits
from .coded_block import BlockRun, CodedBlock, norm_code_lists, stream_major
from .unit_tokens import holds_norms


@dataclass(frozen=True)
class AttendArgs:
    """How :meth:`AttentionOverCodes.attend` reads the codes, beyond its queries and exact part.

    The keys: ``key_frames`` ``[H, D, D]`` (None: identity) and RoPE ``rotation`` as
    :meth:`AttentionOverCodes.key_logits` takes them (with ``rotation_repeats``), the frame
    product's ``precision``, and keys made ahead by ``prepare_keys`` (``prepared``: with the
    same blocks, frames, rotation and precision; the same bits). The values: ``value_frames``
    turn their sums out of the coding frame. The logits: ``softcap``, then ``bias`` added.
    Blocks coded across ``heads`` KV heads: ``exact_queries`` and each head's stored scales
    (``key_scales``, ``value_scales``), as :meth:`AttentionOverCodes.attend` describes."""

    key_frames: Optional[torch.Tensor] = None
    rotation: Optional[torch.Tensor] = None
    rotation_repeats: int = 1
    precision: str = "float32"
    prepared: Any = None
    value_frames: Optional[torch.Tensor] = None
    softcap: Optional[float] = None
    bias: Optional[torch.Tensor] = None
    exact_queries: Optional[torch.Tensor] = None
    heads: int = 1
    key_scales: Any = None
    value_scales: Any = None


class AttentionOverCodes:
    """The codec's attention over a pipeline's coded blocks (needs the pipeline's ``recipe``)."""

    def key_logits(
        self,
        blocks: list[CodedBlock] | BlockRun,
        rows: int,
        queries: torch.Tensor,
        frames: Optional[torch.Tensor],
        rotation: Optional[torch.Tensor],
        precision: str = "float32",
        rotation_repeats: int = 1,
    ) -> torch.Tensor:
        """Attention logits ``[rows, H, G, T]`` of ``queries`` ``[rows, H, G, D]`` against the
        keys coded in ``blocks``, computed by the codec block by block with no decoded copy:
        ``q . rope_t(y_t @ frames[h])``, times the token-norm scale of :meth:`decode_codes`.
        ``frames`` ``[H, D, D]`` (None: identity); ``rotation`` ``[rows or 1, T, 2, pairs]``,
        the cosines then the sines turning channel pairs ``(i, i + P)``, ``P = pairs *
        rotation_repeats``, pair ``i`` by angle ``i % pairs`` (None: no RoPE).
        ``precision``: the frame product's arithmetic (``codec.coded_key_logits``). CPU
        float32."""
        run = self.run_of(blocks, "k")
        h, g, streams = queries.shape[1], queries.shape[2], run.streams
        logits = _codec.coded_key_logits(
            run.layers,
            streams,
            _np(queries.reshape(streams, g, -1)),
            _np_or_none(frames),
            _np_or_none(rotation),
            run.norms,
            precision=precision,
            rotation_repeats=rotation_repeats,
        )
        return torch.from_numpy(logits).view(rows, h, g, -1)

    def value_sums(
        self, blocks: list[CodedBlock] | BlockRun, rows: int, weights: torch.Tensor
    ) -> torch.Tensor:
        """``sum_t weights[..., t] * y_t`` ``[rows, H, G, D]`` over the values coded in
        ``blocks`` (``weights`` ``[rows, H, G, T]``), in the coding frame (apply
        :meth:`frame_inverse` after), token-norm scales included, with no decoded copy. CPU
        float32."""
        run = self.run_of(blocks, "v")
        h, g, streams = weights.shape[1], weights.shape[2], run.streams
        sums = _codec.coded_value_sums(
            run.layers, streams, _np(weights.reshape(streams, g, -1)), run.norms
        )
        return torch.from_numpy(sums).view(rows, h, g, -1)

    def attend(
        self,
        kv_blocks: tuple[list[CodedBlock] | BlockRun, list[CodedBlock] | BlockRun],
        rows: int,
        queries: torch.Tensor,
        exact: tuple[torch.Tensor | list, torch.Tensor | list],
        scaling: float,
        args: AttendArgs = AttendArgs(),
    ) -> torch.Tensor:
        """One whole attention ``[rows, H, G, D]`` of ``queries`` ``[rows, H, G, D]`` over the
        keys and values coded in ``kv_blocks`` followed by the ``exact`` keys and values
        ``[rows, H, E, D]``, computed by the codec (:meth:`key_logits`, a softmax, then
        :meth:`value_sums` turned out of the frame by ``value_frames``, plus the exact part;
        ``exact`` keys and values may each be a list of runs ``[rows, H, n_i, D]`` in token
        order, and a bfloat16 run or int8 rows ``[rows, H, n_i, D + 2]``, ``hf/int8_rows.py``,
        are read as held, with no float32 copy).
        ``bias`` ``[rows, H, G, T + E]``, ``[rows, 1, ...]`` or ``[1, 1, ...]`` is added to the
        (``scaling``-scaled, ``softcap``-ped) logits; a row masked whole gets zeros. For the
        few query rows of a decode step. ``precision``: the key frame product's arithmetic,
        ``rotation_repeats`` as :meth:`key_logits` takes it (``codec.coded_key_logits``). CPU
        float32.

        Blocks coded across ``heads`` KV heads (one stream of ``heads * D`` coordinates per
        row): ``queries`` ``[rows, 1, G, heads * D]`` are the wide queries in the key frame's
        coordinates, ``G`` rows in ``heads`` equal groups, one per head; ``exact_queries``
        ``[rows, heads, G / heads, D]`` each row over its own head's channels, in the exact
        keys' order; ``exact`` runs ``[rows, heads, n_i, D]``; ``value_frames`` ``[heads,
        heads * D, D]`` (:meth:`joint_head_frames`); ``key_scales`` / ``value_scales``
        ``[rows, heads, T]`` (:meth:`joint_scales`), or their codes as a :class:`BlockRun`
        holds them (``scales``), which the codec decodes itself. The output is then ``[rows,
        1, G, D]``.
        ``prepared``: the keys made ahead by :meth:`prepare_keys` with the same blocks,
        ``key_frames``, ``rotation`` (the same tensor) and ``precision``; the same bits. Every
        name of this paragraph and the last is a field of ``args`` (:class:`AttendArgs`)."""
        kr, vr = self.run_of(kv_blocks[0], "k"), self.run_of(kv_blocks[1], "v")
        (ek, ev), streams, heads = exact, kr.streams, args.heads
        h, g, w = queries.shape[1], queries.shape[2], queries.shape[3]
        d = w // heads
        bias, exact_queries = args.bias, args.exact_queries
        if bias is not None:
            bias = bias.reshape(-1, g, bias.shape[-1])
        if exact_queries is not None:
            exact_queries = exact_queries.reshape(streams, g, d)
        out = _codec.coded_attend(
            kr.layers,
            vr.layers,
            streams,
            _np(queries.reshape(streams, g, w)),
            _runs_np(ek, streams * heads, d),
            _runs_np(ev, streams * heads, d),
            scaling,
            key_frames=_np_or_none(args.key_frames),
            rotation=_np_or_none(args.rotation),
            key_norms=kr.norms,
            value_frames=_np_or_none(args.value_frames),
            value_norms=vr.norms,
            bias=_np_or_none(bias),
            softcap=args.softcap,
            heads=heads,
            exact_queries=_np_or_none(exact_queries),
            key_scales=_scales_arg(args.key_scales),
            value_scales=_scales_arg(args.value_scales),
            precision=args.precision,
            prepared=args.prepared,
            rotation_repeats=args.rotation_repeats,
        )
        return torch.from_numpy(out).view(rows, h, g, d)

    def prepare_keys(
        self,
        key_blocks: list[CodedBlock] | BlockRun,
        *,
        key_frames: Optional[torch.Tensor] = None,
        rotation: Optional[torch.Tensor] = None,
        precision: str = "float32",
        background: bool = True,
        rotation_repeats: int = 1,
    ) -> Any:
        """The keys of ``key_blocks`` as :meth:`attend` makes them from ``key_frames``,
        ``rotation`` (``rotation_repeats``) and ``precision`` (decoded, through the frame,
        turned by RoPE), made ahead (``codec.prepare_keys``): on an idle worker of the codec's
        pool with ``background`` (None where there is none), else now. Pass the result to
        :meth:`attend` as ``prepared``; keep ``key_frames`` and ``rotation`` unchanged while
        it lives."""
        kr = self.run_of(key_blocks, "k")
        return _codec.prepare_keys(
            kr.layers,
            kr.streams,
            key_frames=_np_or_none(key_frames),
            rotation=_np_or_none(rotation),
            precision=precision,
            background=background,
            rotation_repeats=rotation_repeats,
            token_norms=kr.norms is not None,
        )

    def run_of(self, blocks: list[CodedBlock] | BlockRun, stream: str) -> BlockRun:
        """``blocks`` of ``stream`` laid out for the attention kernels (a :class:`BlockRun` is
        returned as it is)."""
        if isinstance(blocks, BlockRun):
            return blocks
        encs, streams = stream_major(blocks)
        norms = scales = None
        # Their codes, decoded in the kernels (across heads they are per-head scales, which
        # attention over the codes applies itself).
        if holds_norms(blocks):
            codes = norm_code_lists(blocks)
            if self.recipe.joint(stream):
                scales = codes
            else:
                norms = codes
        tokens = sum(blk.tokens for blk in blocks)
        return BlockRun(_codec.core_layers(encs), streams, norms, tokens, tuple(blocks), scales)


def _np(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous float32 numpy view of a CPU tensor (a copy only where it must)."""
    if t.dtype is torch.float32 and not t.requires_grad and t.is_contiguous():
        return t.numpy()  # the common case, without three no-op tensor calls
    return t.detach().to(torch.float32).contiguous().numpy()


def _runs_np(runs: Any, streams: int, d: int) -> list:
    """Exact keys or values (a tensor, or a list of runs in token order) as the codec takes
    them: ``[streams, n, d]`` arrays, float32, a bfloat16 run as its raw bits (uint16), or
    int8 rows ``[streams, n, d + 2]`` (``hf/int8_rows.py``) as they are."""
    out = []
    for t in [runs] if isinstance(runs, torch.Tensor) else runs:
        if t.dtype is torch.int8:
            out.append(t.detach().reshape(streams, -1, t.shape[-1]).contiguous().numpy())
            continue
        t = t.detach().reshape(streams, -1, d)
        out.append(bf16_bits(t.contiguous()) if t.dtype is torch.bfloat16 else _np(t))
    return out


def _np_or_none(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """:func:`_np` of an optional tensor."""
    return None if t is None else _np(t)


def _scales_arg(scales: Any) -> Any:
    """Heads' scales as the codec takes them: a tensor as :func:`_np` makes it, codes (a
    ``(codes, bounds)`` pair of lists) as they are."""
    return scales if isinstance(scales, tuple) else _np_or_none(scales)
