"""Attention over a layer's compressed blocks without decoding them into dense keys and values.

A :class:`~kakeyaturbo.hf.layer.KakeyaLayer` whose model attends through the ``"kakeya"``
attention (``hf/attention.py``) returns only the new tokens from ``update`` and leaves a
:class:`CodedView` for the attention of the same forward: its blocks, and its other exact tokens
(the sinks that sit in blocks, the hot window) as they are held. :meth:`CodedView.attend` then
computes one softmax over the coded and the exact tokens:

- **keys** of the blocks are taken through the frame (one ``[D, D]`` product per head and token,
  into a channel order where each RoPE pair is ``(i, i + rot_dim/2)``), turned to their RoPE
  positions and scored against all query heads of their KV head (no ``repeat_kv`` copy), with
  the rotation computed once per forward for all layers. Keys coded post-RoPE stay in the
  frame: the query is taken into it instead (``q M^T``), once per query row;
- **values** are never taken out of the frame per token: attention is linear in them, so
  ``sum_t p_t v_t = (sum_t p_t y_t) @ M`` and the frame ``M`` is applied once per query;
- **sinks** are read exact: their coded slots (which hold the block mean) are masked out and the
  exact sink keys and values lead the exact part;
- **blocks coded across heads** (the recipe's ``joint_heads``) are read as one virtual KV head
  of width ``H*D`` (``coded_joint.py``); what every layer of a forward computes alike (RoPE's
  rotation, the mask's bias) is made once per forward (``coded_bias.py``).

On the CPU the codec computes both sums itself (``Pipeline.key_logits`` / ``value_sums``, the
Rust ``coded_attention`` kernels; for a decode step's few query rows the whole attention,
softmax and exact part included, in one call, ``Pipeline.attend``): each block is decoded
into a scratch buffer that stays in cache and finished there (frame, RoPE, logits; norms,
weighted sum), blocks in parallel, so no decoded copy of the layer is ever written. On other
devices (:func:`reads_on_device`) the layer holds its blocks there as stored, and only there
(their packed codes and side values: :class:`~kakeyaturbo.device_decode.DeviceBlocks`,
``KakeyaLayer._on_device``), decodes them to frame coordinates there each call, and the same
arithmetic runs in torch (``CPU_KERNELS = False`` runs that path on the CPU too); on a GPU,
Triton kernels take the decode, the token norms and the logits of keys coded across heads
(``fused_decode.py``, ``fused_attention.py``), and a decode step's softmax, value sums and
exact part over blocks coded across heads (``fused_joint_attend.py``). Nothing decoded
outlives the call, so the cache holds what its ``memory_report`` says. The codes are the ones
the dense path decodes: outputs agree with it to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..attend import AttendArgs
from ..coded_block import BlockRun
from ..gpu import fused_joint_attend
from ..gpu.device_decode import DeviceBlocks
from . import int8_rows
from .coded_bias import SharedInputs, grouped_heads
from .coded_joint import JointHeadsAttention

#: Where attention over the codes computes on the CPU: with the codec's kernels (each block
#: decoded into a cache-sized scratch and finished there, no decoded copy of the layer; the
#: default), or with torch ops over the decoded frame coordinates, as on other devices.
CPU_KERNELS = True


def reads_on_device(device: torch.device) -> bool:
    """Whether attention over the codes of a layer on ``device`` decodes the blocks there
    (off the CPU kernels): a layer on such a device holds its blocks there, and only there."""
    return not (CPU_KERNELS and device.type == "cpu")


#: Up to this many query rows per KV head (query heads per KV head x query tokens), the CPU
#: kernels compute the whole attention, softmax and exact part included, in one call
#: (``Pipeline.attend``), instead of a dozen small torch ops per layer between the two kernels
#: (3-6% of a decode step, ``benches/attention_paths.py``). Longer queries (prefill) leave the
#: softmax and the exact part (a GEMM there) to torch.
WHOLE_ATTENTION_ROWS = 64

#: With ``prepare_keys_ahead``, how many following compressed layers' keys the codec's idle
#: worker is making at a time. One layer ahead, the worker sat idle once it met the next
#: layer's attention, and that attention computed about a quarter of the blocks itself; two
#: ahead keep it busy while the main thread attends, at one more layer's keys alive at a time
#: (3 MB per layer at 4k for SmolLM2, freed when read: nothing lives from one step to the next).
LAYERS_AHEAD = 2


@dataclass(frozen=True, eq=False)
class LayerBlocks:
    """A layer's blocks as attention over the codes reads them. A cache's blocks change only
    when it compresses, crops or selects rows, so the layer builds this then (``of``) and every
    step reuses it, instead of laying the blocks out again per layer and step."""

    blocks: list  # the layer's _Block objects, oldest first (a copy of its list)
    sinks: torch.Tensor | None  # [B, S] bool: sinks whose slot is in a block (held exact here)
    tokens: int  # coded tokens per stream
    # The blocks' keys and values laid out for the codec's kernels (None where the layer
    # holds its blocks only on a device: ``device_held``).
    keys: BlockRun | None
    values: BlockRun | None
    # The blocks' stored positions as CodedView._rotation compares them (empty without RoPE).
    positions: tuple
    # The layer's blocks where it holds them only on a device (KakeyaLayer._on_device), by
    # stream, else None.
    device_held: dict | None = None
    # Copies of host-held blocks on a device for decoding there (off the CPU kernels), by
    # (stream, device).
    on_device: dict = field(default_factory=dict)

    @classmethod
    def of(cls, layer: Any, sinks: torch.Tensor | None) -> LayerBlocks:
        blocks, pipe = list(layer._blocks), layer._ctx.pipeline
        positions = ()
        if layer._rope is not None:
            positions = tuple((blk.pos.shape, blk.pos_key) for blk in blocks)
        tokens = sum(blk.tokens for blk in blocks)
        if layer._on_device is not None:
            return cls(blocks, sinks, tokens, None, None, positions, layer._on_device)
        keys = pipe.run_of([blk.k for blk in blocks], "k")
        values = pipe.run_of([blk.v for blk in blocks], "v")
        return cls(blocks, sinks, tokens, keys, values, positions)

    def stored(self, stream: str, device: torch.device) -> DeviceBlocks:
        """The blocks' ``stream`` held on ``device``, where attention decodes them with torch
        (off the CPU kernels): the layer's own where it holds them there, else copied there
        from the host once, on first use after the blocks change."""
        if self.device_held is not None:
            held = self.device_held[stream]
            if held.device != device:
                raise ValueError(
                    f"the cache holds this layer's blocks on {held.device}, the model attends "
                    f"on {device}: a cache stays on the device it was filled on"
                )
            return held
        key = (stream, str(device))
        if key not in self.on_device:
            blocks = [getattr(blk, stream) for blk in self.blocks]
            self.on_device[key] = DeviceBlocks.of(blocks, device)
        return self.on_device[key]


@dataclass(eq=False)
class CodedView(JointHeadsAttention, SharedInputs):
    """One layer's blocks as they were when this forward's ``update`` ran."""

    layer: Any  # the KakeyaLayer (layer.py imports this module)
    held: LayerBlocks
    # The layer's exact tokens before this forward's (sinks held beside the blocks, hot
    # window): keys and values as runs in token order, as held (set by exact_part).
    runs: tuple = ((), ())

    @property
    def blocks(self) -> list:
        return self.held.blocks

    @property
    def sinks(self) -> torch.Tensor | None:
        return self.held.sinks

    @property
    def coded_length(self) -> int:
        return self.held.tokens

    def exact_part(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns for this forward: the new tokens ``k``, ``v``. The layer's
        other exact tokens, the sinks held beside the blocks (all ``S`` of them; :meth:`attend`
        masks those that are not in a block) and the hot window, are kept here as runs as they
        are held (a bfloat16 window stays bfloat16 and values held as int8 rows stay int8
        rows: the codec reads them so, with no float32 copy per step), and :meth:`attend` puts
        them before the new ones."""
        lay = self.layer
        # Int8 rows stay as held: the codec reads them so (the torch path decodes them).
        ks, vs = [lay._hot_k], [lay._hot_v]
        if self.sinks is not None:  # views of the held [B, S, H, D]: read in place or copied once
            ks.insert(0, lay._sink_k.transpose(1, 2))
            vs.insert(0, lay._sink_v.transpose(1, 2))
        self.runs = (ks, vs)
        return k, v

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, Tq, Hq, D]`` (query dtype) of ``query`` ``[B, Hq, Tq, D]``
        over the blocks, the exact tokens held (:attr:`runs`) and the new ones, ``key`` /
        ``value`` (what :meth:`exact_part` returned)."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        b, hq, tq, d = query.shape
        h = key.shape[1]
        if hq % h:
            raise ValueError(f"{hq} query heads do not group over {h} KV heads")
        g, dev = hq // h, query.device
        clen = self.coded_length
        key_runs, value_runs = [*self.runs[0], key], [*self.runs[1], value]
        kernels = self.held.keys is not None and not reads_on_device(dev)
        joint_k, joint_v = pipe.recipe.joint("k"), pipe.recipe.joint("v")
        if not kernels and joint_k and joint_v and hq * tq <= fused_joint_attend.MAX_ROWS:
            grouped = query.reshape(b, h, g * tq, d)
            exact = (key_runs, value_runs)
            return self._device_joint_attend(grouped, exact, attention_mask, scaling, softcap, tq)
        q = query.float().reshape(b, h, g * tq, d)  # query head i*g + j reads KV head i

        if kernels and g * tq <= WHOLE_ATTENTION_ROWS and joint_k == joint_v:
            exact = (key_runs, value_runs)
            out = self._codec_attend(q, exact, attention_mask, scaling, softcap, tq)
            self._prepare_next(h, d)
            return _as_returned(out.view(b, hq, tq, d), query.dtype)
        # One copy each: cat promotes a hot window held in a narrower dtype to the states'.
        value_runs = [int8_rows.decode(v) if v.dtype is torch.int8 else v for v in value_runs]
        key, value = torch.cat(key_runs, dim=-2).float(), torch.cat(value_runs, dim=-2).float()
        if joint_k:
            coded = self._joint_logits(q, kernels)
        elif kernels:
            coded = self._codec_logits(q, self.held.keys)
        else:
            coded = self._torch_logits(q, self.held.stored("k", dev), dev)
        scores = torch.cat((coded, q @ key.transpose(-1, -2)), dim=-1)
        scores.mul_(scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        bias = self._shared_bias(attention_mask, b, tq, key.shape[-2], dev)
        scores = scores.view(b, h, g, tq, -1)
        scores += bias.view(bias.shape[0], *grouped_heads(bias.shape[1], h, g), tq, -1)
        # A query row with every key masked (a padded row) gets zeros, not NaN.
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).view(b, h, g * tq, -1)

        if joint_v:
            out = self._joint_value_sums(probs[..., :clen], kernels)
        elif kernels:
            out = pipe.value_sums(self.held.values, b, probs[..., :clen])
        else:
            values, v_scale = pipe.decode_codes(self.held.stored("v", dev), "v", b)
            weights = probs[..., :clen]
            if v_scale is not None:
                weights = weights * v_scale[:, :, None]
            out = weights @ values
        frame = None if joint_v else pipe.frame_inverse(li, "v", dev)
        if frame is not None:
            out = out @ frame
        out += probs[..., clen:] @ value
        return _as_returned(out.view(b, hq, tq, d), query.dtype)

    def _codec_attend(
        self,
        q: torch.Tensor,
        exact: tuple[list, list],
        mask: Any,
        scaling: float,
        softcap: float | None,
        tq: int,
    ) -> torch.Tensor:
        """The whole attention ``[B, H, g*Tq, D]`` by the codec (``Pipeline.attend``) over the
        blocks and the exact runs ``exact`` (keys, values: lists of ``[B, H, n, D]``, as
        held): the CPU path for few query rows (blocks coded across heads: ``[B, 1, H*g*Tq,
        D]``, :meth:`_joint_attend`)."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        (keys, values), (b, h, rows, _) = exact, q.shape
        n_exact = sum(k.shape[-2] for k in keys)
        joint = pipe.recipe.joint("k")
        bias = self._kernel_bias(mask, (b, h, rows // tq, tq), n_exact, q.device, joint)
        if joint:
            return self._joint_attend(q, exact, bias, scaling, softcap)
        frame, rotation, _ = self._key_inputs(h, q.shape[-1])
        if lay._rope is not None:  # the exact keys follow the query into the paired order
            _, (q, *keys) = self._split_layout(None, q, *keys)
        # (Keys coded post-RoPE go through the frame per token here: the exact keys are
        # scored by the same query, which the frame cannot be folded into for them.)
        return pipe.attend(
            (self.held.keys, self.held.values),
            b,
            q,
            (keys, values),
            scaling,
            AttendArgs(
                key_frames=frame,
                rotation=rotation,
                value_frames=pipe.frame_inverse(li, "v"),
                bias=bias,
                softcap=softcap,
                precision=lay._ctx.attention_precision,
                prepared=self._prepared(),
            ),
        )

    def _key_inputs(self, h: int, d: int) -> tuple[Any, Any, int]:
        """The key frames, RoPE's rotation and its repeats as ``Pipeline.attend`` takes them
        for this layer's blocks (``h`` KV heads of ``d`` channels): across heads the joint
        frame ``[1, H*D, H*D]`` and one head's rotation repeated over the heads
        (:meth:`_joint_query`); per head the frames in the split channel order
        (:meth:`_split_layout`) and the rotation."""
        lay = self.layer
        if lay._ctx.pipeline.recipe.joint("k"):
            frame, rotation = self._joint_keys(h, d, repeated=False)
            return frame[None], rotation, h
        frame = lay._ctx.pipeline.frame_inverse(lay.layer_idx, "k")
        if lay._rope is None:
            return frame, None, 1
        frame, _ = self._split_layout(frame, torch.empty(1, h, 0, d))
        return frame, self._rotation("split"), 1

    def _prepared(self) -> Any:
        """The keys made ahead for this layer by the layer before (:meth:`_prepare_next`),
        where they were made from the blocks it reads now (a flush since drops them)."""
        made = self.layer._ctx.step.prepared.pop(self.layer.layer_idx, None)
        return made[1] if made is not None and made[0] is self.held else None

    def _prepare_next(self, h: int, d: int) -> None:
        """Starts making the keys of the next :data:`LAYERS_AHEAD` compressed layers' blocks
        (those not started yet) on the codec's idle worker (``Pipeline.prepare_keys``), while
        the model runs this layer's MLP and the next layers' projections and attention; their
        attention reads them (:meth:`_prepared`). Only where a worker is idle (torch on one
        thread) and those layers will attend over their codes."""
        ctx = self.layer._ctx
        if not ctx.prepare_keys_ahead or ctx.budget.limit:
            return
        lay = self.layer
        for _ in range(LAYERS_AHEAD):
            ref = ctx.following.get(lay.layer_idx)
            lay = None if ref is None else ref()
            if lay is None:
                return
            if not lay._blocks or lay._on_device is not None or lay.layer_idx in ctx.step.prepared:
                continue
            view = CodedView(lay, lay._held_blocks())
            frame, rotation, repeats = view._key_inputs(h, d)
            made = ctx.pipeline.prepare_keys(
                view.held.keys,
                key_frames=frame,
                rotation=rotation,
                precision=ctx.attention_precision,
                rotation_repeats=repeats,
            )
            if made is None:
                return
            ctx.step.prepared[lay.layer_idx] = (view.held, made)

    def _codec_logits(self, q: torch.Tensor, kb: BlockRun) -> torch.Tensor:
        """Logits ``[B, H, g*Tq, coded]`` of the blocks' keys, computed by the codec block by
        block (decode, frame, RoPE, dot) with no decoded copy of the layer: the CPU path."""
        lay = self.layer
        pipe = lay._ctx.pipeline
        frame = pipe.frame_inverse(lay.layer_idx, "k")
        if lay._rope is None:
            # Keys coded post-RoPE never leave the frame: q . (y M) = (q M^T) . y.
            qf = q if frame is None else q @ frame.transpose(-1, -2)
            return pipe.key_logits(kb, q.shape[0], qf, None, None)
        frame, (q,) = self._split_layout(frame, q)
        rotation, precision = self._rotation("split"), lay._ctx.attention_precision
        return pipe.key_logits(kb, q.shape[0], q, frame, rotation, precision)

    def _split_layout(
        self, frame: torch.Tensor | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """The key frame and ``tensors`` (the query, exact keys: ``[..., D]``) in the channel
        order where each RoPE pair is ``(i, i + rot_dim/2)``, where the codec turns keys over
        contiguous halves: the frame's columns permuted, free (already so for half-split
        RoPE; an identity frame becomes the permutation)."""
        d = tensors[0].shape[-1]
        order = self.layer._rope.split_order(d)
        if order is None:
            return frame, tensors
        heads = tensors[0].shape[1]
        frame = torch.eye(d).expand(heads, d, d) if frame is None else frame
        return frame.index_select(-1, order), tuple(t.index_select(-1, order) for t in tensors)

    def _torch_logits(self, q: torch.Tensor, kb: DeviceBlocks, dev) -> torch.Tensor:
        """:meth:`_codec_logits` on another device: the blocks held there decoded to frame
        coordinates there (where the positions, so RoPE's rotation, already are), the rest
        in torch."""
        lay = self.layer
        pipe, d = lay._ctx.pipeline, q.shape[-1]
        # Token norms (when a stream has them) scale a token's logit: attention is linear in
        # each key, so no decoded vector is rescaled.
        keys, k_scale = pipe.decode_codes(kb, "k", q.shape[0])
        frame = pipe.frame_inverse(lay.layer_idx, "k", dev)
        if lay._rope is not None:
            order = self._paired_order(d, dev)
            keys = keys[..., order] if frame is None else keys @ frame[..., order]
            keys = lay._rope.turn_paired(keys, self._rotation("complex").to(dev))
            coded = q[..., order] @ keys.transpose(-1, -2)
        else:
            qf = q if frame is None else q @ frame.transpose(-1, -2)
            coded = qf @ keys.transpose(-1, -2)
        if k_scale is not None:
            coded.mul_(k_scale[:, :, None])
        return coded

    def _paired_order(self, d: int, dev: torch.device) -> torch.Tensor:
        """RoPE's paired channel order on ``dev``, built once per forward for the layers
        sharing a RoPE."""
        rope = self.layer._rope
        return self._shared(
            ("paired_order", d, rope.rot_dim, rope.adjacent_pairs, str(dev)),
            (),
            lambda: rope.paired_order(d).to(dev),
        )


def _as_returned(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention's output ``[B, Hq, Tq, D]`` as an attention function returns it: ``[B, Tq, Hq,
    D]``, contiguous, in ``dtype``, by one copy (one kernel on a GPU, not two)."""
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
