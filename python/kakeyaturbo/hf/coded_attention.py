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
- **blocks coded across heads** (the recipe's ``joint_heads``: one stream of ``H*D``
  coordinates per row) are read as one virtual KV head of width ``H*D``: the frame takes the
  coordinates to all heads' keys side by side, each head's RoPE pairs laid out so that the
  kernel's pairs ``(i, i + H*rot_dim/2)`` are real pairs with the angles tiled ``H`` times, and
  each query head's query is zero outside its own head's channels; the value sums run over the
  joint coordinates with each head's stored scale folded into its weights, and each head's
  slice of the joint frame turns them out. Three times the key frame product of per-head
  frames on a 3-head layer: the cost of the better coding (``docs/speed.md``). A decode step's
  whole attention over them is one codec call too, each head's query rows reading their own
  head's scales, exact tokens and slice of the value frame in it.

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

from ..gpu import fused_attention, fused_joint_attend
from ..gpu.device_decode import DeviceBlocks
from ..pipeline import BlockRun
from . import int8_rows
from .same_tensors import same

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
#: ahead keep it busy while the main thread attends (about 5% of a 4k step on a 2-core Zen 1,
#: docs/speed.md, 29th session), at one more layer's keys alive at a time (3 MB per layer at
#: 4k for SmolLM2, freed when read: nothing lives from one step to the next).
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
class CodedView:
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
        scores += bias.view(bias.shape[0], *_grouped_heads(bias.shape[1], h, g), tq, -1)
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
            key_frames=frame,
            rotation=rotation,
            value_frames=pipe.frame_inverse(li, "v"),
            bias=bias,
            softcap=softcap,
            precision=lay._ctx.attention_precision,
            prepared=self._prepared(),
        )

    def _joint_attend(
        self, q: torch.Tensor, exact: tuple, bias: Any, scaling: float, softcap: float | None
    ) -> torch.Tensor:
        """:meth:`_codec_attend` of blocks coded across heads, ``[B, 1, H*g*Tq, D]``: the
        wide queries and the joint key frame as :meth:`_joint_logits` reads them, and per
        head its query rows' exact part, its scales and its slice of the joint value frame
        (``Pipeline.attend`` with ``heads``)."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        wide, frame, rotation = self._joint_query(q)
        norms = pipe.recipe.token_norms
        h = q.shape[1]
        return pipe.attend(
            (self.held.keys, self.held.values),
            q.shape[0],
            wide,
            exact,
            scaling,
            key_frames=frame[None],
            rotation=rotation,
            value_frames=pipe.joint_head_frames(li, "v"),
            bias=bias,
            softcap=softcap,
            heads=h,
            exact_queries=q,
            # Their codes as held: the codec decodes them in the same call.
            key_scales=self.held.keys.scales if norms("k") else None,
            value_scales=self.held.values.scales if norms("v") else None,
            precision=lay._ctx.attention_precision,
            prepared=self._prepared(),
            rotation_repeats=h,
        )

    def _device_joint_attend(
        self, q: torch.Tensor, exact: tuple, mask: Any, scaling: float, softcap: Any, tq: int
    ) -> torch.Tensor:
        """A decode step's attention ``[B, Tq, Hq, D]`` (the query's dtype) over blocks coded
        across heads off the CPU kernels, ``q`` ``[B, H, g*Tq, D]`` as the model gave it: the
        keys' logits from the coordinates decoded on the device (:meth:`_device_joint_logits`),
        then the softmax, the value sums and the exact part by two Triton kernels on a GPU
        (``fused_joint_attend.py``), else by their torch twin. The exact runs are read as held
        (int8 rows, the sinks' layout), with no concatenated copy."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        (b, h, rows, _), dev = q.shape, q.device
        kb, vb = self.held.stored("k", dev), self.held.stored("v", dev)
        norms = pipe.recipe.token_norms
        coded = fused_joint_attend.Coded(
            self._device_joint_logits(pipe.joint_codes(kb, b), q),
            _scales_as_held(pipe, kb) if norms("k") else None,
            pipe.joint_codes(vb, b),
            _scales_as_held(pipe, vb) if norms("v") else None,
            pipe.joint_head_frames(li, "v", dev),
        )
        n_exact = sum(k.shape[-2] for k in exact[0])
        bias = self._kernel_bias(mask, (b, h, rows // tq, tq), n_exact, dev, joint=True)
        args = (coded, q, *exact, bias, scaling, softcap, tq, q.dtype)
        if fused_joint_attend.usable(*args):
            return fused_joint_attend.attend(*args)
        return fused_joint_attend.attend_with_torch(*args)

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

    def _joint_logits(self, q: torch.Tensor, kernels: bool) -> torch.Tensor:
        """:meth:`_codec_logits` of blocks coded across heads (``[B, H, g*Tq, coded]``): by the
        codec's kernel as one virtual KV head of width ``H*D`` (see the module docstring), or,
        off the CPU, from the coordinates decoded on the device (:meth:`_device_joint_logits`)."""
        lay = self.layer
        pipe = lay._ctx.pipeline
        b, h, rows, d = q.shape
        if kernels:
            wide, frame, rotation = self._joint_query(q)
            precision = lay._ctx.attention_precision
            logits = pipe.key_logits(
                self.held.keys, b, wide, frame[None], rotation, precision, rotation_repeats=h
            )
            held = self.held.keys
        else:
            held = self.held.stored("k", q.device)
            logits = self._device_joint_logits(pipe.joint_codes(held, b), q)
        logits = logits.view(b, h, rows, -1)
        if pipe.recipe.token_norms("k"):
            logits = logits * pipe.joint_scales(held)[:, :, None]
        return logits

    def _joint_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The queries ``q`` ``[B, H, rows, D]`` (on the CPU) as the codec's kernels score
        keys coded across heads: wide queries ``[B, 1, H*rows, H*D]`` (each row zero outside
        its head's channels), the joint key frame ``[H*D, H*D]`` and one head's RoPE rotation,
        which the kernels repeat over the heads (``rotation_repeats``), in the channel order
        of :meth:`_joint_order` (with RoPE; else the rotation is None)."""
        b, h, rows, d = q.shape
        frame, rotation = self._joint_keys(h, d, repeated=False)
        # Query head i*g + j reads KV head i: its own channels only.
        order = None if rotation is None else self._joint_order_shared(h, d)[1]
        wide = fused_attention.wide_queries(q, order)
        return wide.view(b, 1, h * rows, h * d), frame, rotation

    def _device_joint_logits(self, y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, H*rows, T]`` of the queries ``q`` ``[B, H, rows, D]`` against keys coded
        across heads whose coordinates ``y`` ``[B, T, H*D]`` were decoded on the device (off
        the CPU kernels): with RoPE by one Triton kernel on a GPU (``fused_attention.py``),
        else by torch ops; keys coded post-RoPE never leave the frame: ``(wide M^T) y^T``."""
        b, h, rows, d = q.shape
        frame, rotation = self._joint_keys(h, d, q.device)
        if rotation is None:
            wide = fused_attention.wide_queries(q.float())
            return (wide @ frame.T) @ y.transpose(-1, -2)
        order = self._joint_order_shared(h, d, q.device)[1]
        if fused_attention.usable(y, frame, rotation, q, order):
            return fused_attention.joint_key_logits(y, frame, rotation, q, order)
        return fused_attention.joint_key_logits_with_torch(y, frame, rotation, q, order)

    def _joint_keys(
        self, h: int, d: int, dev: Any = "cpu", repeated: bool = True
    ) -> tuple[torch.Tensor, Any]:
        """:meth:`_joint_query`'s joint key frame and rotation (no query needed), on ``dev``:
        the rotation of every head's pairs (``repeated``), or one head's, which the codec's
        kernels repeat themselves (a third of the table they read with three heads)."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        dev = torch.device(dev)
        if lay._rope is None:
            return pipe.joint_frame(li, "k", device=dev), None
        # The bundle keeps the frame in that order.
        frame = pipe.joint_frame(li, "k", self._joint_order_shared(h, d), dev)
        if not repeated:
            return frame, self._rotation("split", dev)
        rotation = self._shared(
            ("joint rotation", h, str(dev), self.held.positions),
            (lay._rope.inv_freq,),
            lambda: self._rotation("split", dev).repeat(1, 1, 1, h),
        )
        return frame, rotation

    def _joint_order_shared(self, h: int, d: int, dev: Any = "cpu") -> tuple[tuple, torch.Tensor]:
        """(its name, :meth:`_joint_order` on ``dev``), made once per forward."""
        rope = self.layer._rope
        name = ("joint order", h, d, rope.rot_dim, rope.adjacent_pairs)
        order = self._shared((*name, str(dev)), (), lambda: self._joint_order(h, d).to(dev))
        return name, order

    def _joint_order(self, h: int, d: int) -> torch.Tensor:
        """The channel order of ``H`` heads side by side in which the kernel's pairs ``(i, i +
        H*rot_dim/2)`` are each head's RoPE pairs: every head's first halves, then every head's
        second halves (the same order), then the unrotated channels."""
        rope = self.layer._rope
        half = rope.rot_dim // 2
        own = rope.split_order(d)
        own = torch.arange(d) if own is None else own
        parts = (own[:half], own[half : 2 * half], own[2 * half :])
        return torch.cat([i * d + part for part in parts for i in range(h)])

    def _joint_value_sums(self, weights: torch.Tensor, kernels: bool) -> torch.Tensor:
        """``sum_t weights_t v_t`` ``[B, H, g*Tq, D]`` over values coded across heads: the
        codec's sums over the joint coordinates, each head's scale folded into its weights and
        each head's slice of the joint frame turning them out (off the CPU, the same sums over
        the coordinates decoded on the device)."""
        lay = self.layer
        pipe, li = lay._ctx.pipeline, lay.layer_idx
        b, h, rows, t = weights.shape
        dev = weights.device
        held = self.held.values if kernels else self.held.stored("v", dev)
        if pipe.recipe.token_norms("v"):
            weights = weights * pipe.joint_scales(held)[:, :, None]
        if kernels:
            sums = pipe.value_sums(held, b, weights.reshape(b, 1, h * rows, t))
        else:  # the coordinates decoded on the device, never taken to every head per token
            sums = weights.reshape(b, h * rows, t) @ pipe.joint_codes(held, b)
        return sums.view(b, h, rows, -1) @ pipe.joint_head_frames(li, "v", dev)

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

    def _rotation(self, form: str, dev: Any = None) -> Any:
        """RoPE's rotation at the coded positions, ``"complex"`` (:meth:`RotarySpec.rotation`),
        ``"split"`` (:meth:`RotarySpec.split_rotation`) or ``"cos_sin"`` (the pair of
        :meth:`RotarySpec.cos_sin`), on ``dev`` (default: where the positions are). Every layer
        of a forward codes the same token positions: computed once per forward and RoPE. The
        blocks' stored positions (a row's first one, or all) tell equal position sets apart
        without expanding them."""
        rope, blocks = self.layer._rope, self.blocks
        make = {"complex": rope.rotation, "split": rope.split_rotation, "cos_sin": rope.cos_sin}
        dev = blocks[0].pos.device if dev is None else dev
        return self._shared(
            ("rotation", form, str(dev), self.held.positions),
            (rope.inv_freq,),
            lambda: make[form](torch.cat([blk.positions for blk in blocks], dim=-1), dev),
        )

    def _shared_bias(self, mask: Any, b: int, tq: int, exact: int, dev) -> torch.Tensor:
        # Layers of a forward share the mask and the sinks' slots: the bias is built once and
        # reused while its inputs match.
        return self._shared(
            ("bias", mask is None, b, tq, exact, self.coded_length),
            self._bias_inputs(mask),
            lambda: self._bias(mask, b, tq, exact, dev),
        )

    def _kernel_bias(
        self, mask: Any, dims: tuple, exact: int, dev, joint: bool = False
    ) -> torch.Tensor | None:
        """:meth:`_shared_bias` as ``Pipeline.attend`` takes it: ``[B or 1, H or 1, g*Tq,
        coded + exact]``, each KV head's query rows in the query's order (``dims`` = ``(B, H,
        g, Tq)``), or with ``joint`` (one stream across the heads) ``[B or 1, 1, H*g*Tq,
        coded + exact]``; None where it adds nothing (a decode step without sinks)."""
        b, h, g, tq = dims

        def make():
            bias = self._shared_bias(mask, b, tq, exact, dev)
            if not bias.any():
                return None
            mh, mg = _grouped_heads(bias.shape[1], h, g)
            grouped = bias.view(bias.shape[0], mh, mg, tq, -1)
            if mh > 1:  # per-head rows: one per stream, so every batch row its own
                grouped = grouped.expand(b, -1, -1, -1, -1)
            grouped = grouped.expand(-1, -1, g, -1, -1)
            if joint:  # every head's rows in one stream's
                grouped = grouped.expand(-1, h, -1, -1, -1)
                return grouped.reshape(grouped.shape[0], 1, h * g * tq, -1)
            return grouped.reshape(grouped.shape[0], mh, g * tq, -1)

        return self._shared(
            ("kernel bias", mask is None, dims, exact, self.coded_length, joint),
            self._bias_inputs(mask),
            make,
        )

    def _bias_inputs(self, mask: Any) -> tuple:
        """The tensors a forward's bias is built from: the mask and the sinks' slots."""
        inputs = () if mask is None else (mask,)
        if self.sinks is not None:
            inputs += (self.sinks, self.layer._sink_idx)
        return inputs

    def _shared(self, key: tuple, tensors: tuple, make) -> Any:
        """``make()``, computed once per forward for equal ``key`` and equal ``tensors``."""
        memo = self.layer._ctx.step.shared
        for k, ts, value in memo:
            if k == key and all(same(a, t) for a, t in zip(ts, tensors)):
                return value
        value = make()
        memo.append((key, tensors, value))
        return value

    def _bias(self, mask: Any, b: int, tq: int, exact: int, dev) -> torch.Tensor:
        """Additive float32 bias ``[B or 1, 1 or Hq, Tq, coded + exact]`` for the scores:
        the model's mask (bool: True attends; or additive) over the layer's slots, coded sink
        slots masked out, the exact sinks given their own slots' columns."""
        clen, s_held = self.coded_length, 0 if self.sinks is None else self.sinks.shape[1]
        total = clen + exact - s_held  # the cache slots this forward's mask covers
        bias = mask_bias(mask, tq, total, dev)
        if bias.shape[-1] != total:
            raise ValueError(
                f"layer {self.layer.layer_idx}: attention mask covers {bias.shape[-1]} keys, "
                f"the cache holds {total}"
            )
        if self.sinks is None:
            return bias
        bias = bias.expand(b, *bias.shape[1:])
        idx = self.layer._sink_idx.to(dev)  # [B, S] cache slots of the sinks
        held = self.sinks.to(dev)
        coded = bias[..., :clen].clone()
        rows, slots = held.nonzero(as_tuple=True)
        coded[rows, :, :, idx[rows, slots]] = float("-inf")
        gather = idx.clamp(max=total - 1)[:, None, None, :].expand(*bias.shape[:3], -1)
        sinks = bias.gather(-1, gather).masked_fill(~held[:, None, None, :], float("-inf"))
        return torch.cat((coded, sinks, bias[..., clen:]), dim=-1)


def _as_returned(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention's output ``[B, Hq, Tq, D]`` as an attention function returns it: ``[B, Tq, Hq,
    D]``, contiguous, in ``dtype``, by one copy (one kernel on a GPU, not two)."""
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def mask_bias(mask: torch.Tensor | None, tq: int, total: int, dev) -> torch.Tensor:
    """An attention mask (bool: True attends; or additive; None: causal over ``total`` slots,
    which is all transformers passes None for) as an additive float32 bias on ``dev``:
    ``[B or 1, 1 or Hq, Tq, slots]``."""
    if mask is None:
        ok = torch.ones(tq, total, dtype=torch.bool, device=dev).tril(total - tq)
        mask = ok[None, None]
    if mask.dtype != torch.bool:
        return mask.to(device=dev, dtype=torch.float32)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=dev)
    return bias.masked_fill_(~mask.to(dev), float("-inf"))


def _grouped_heads(mask_heads: int, h: int, g: int) -> tuple[int, int]:
    """The mask's head dimension in the grouped ``[B, H, g, ...]`` layout of the scores."""
    if mask_heads == 1:
        return 1, 1
    if mask_heads == h * g:
        return h, g
    raise ValueError(f"attention mask has {mask_heads} heads, the model {h * g}")


def _scales_as_held(pipe: Any, held: DeviceBlocks) -> Any:
    """Each head's token scales of blocks coded across heads, for the joint attention kernels:
    their one-byte codes where the blocks are one run of equal blocks (the kernels decode them
    as they load them, one launch fewer per layer and stream), else decoded."""
    runs = held.norms.runs if held.norms is not None else ()
    if len(runs) == 1:
        return fused_joint_attend.ScaleCodes(*runs[0])
    return pipe.joint_scales(held)
