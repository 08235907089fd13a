"""Attention over blocks coded across heads (the recipe's ``joint_heads``: one stream of
``H*D`` coordinates per row), read as one virtual KV head of width ``H*D``: the frame takes the
coordinates to all heads' keys side by side, each head's RoPE pairs laid out so that the kernel's
pairs ``(i, i + H*rot_dim/2)`` are real pairs with the angles tiled ``H`` times, and each query
head's query is zero outside its own head's channels; the value sums run over the joint
coordinates with each head's stored scale folded into its weights, and each head's slice of the
joint frame turns them out. A decode step's whole attention over them is one codec call, each
head's query rows reading their own head's scales, exact tokens and slice of the value frame."""

from __future__ import annotations

from typing import Any

import torch

from ..attend import AttendArgs
from ..gpu import fused_attention, fused_joint_attend
from ..gpu.device_decode import DeviceBlocks
from ..unit_tokens import holds_norms


class JointHeadsAttention:
    """:class:`~kakeyaturbo.hf.coded_attention.CodedView`'s attention over blocks coded across
    heads."""

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
        h = q.shape[1]
        return pipe.attend(
            (self.held.keys, self.held.values),
            q.shape[0],
            wide,
            exact,
            scaling,
            AttendArgs(
                key_frames=frame[None],
                rotation=rotation,
                rotation_repeats=h,
                precision=lay._ctx.attention_precision,
                prepared=self._prepared(),
                value_frames=pipe.joint_head_frames(li, "v"),
                softcap=softcap,
                bias=bias,
                exact_queries=q,
                heads=h,
                # Their codes as held (None: coded without token norms): the codec decodes
                # them in the same call.
                key_scales=self.held.keys.scales,
                value_scales=self.held.values.scales,
            ),
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
        coded = fused_joint_attend.Coded(
            self._device_joint_logits(pipe.joint_codes(kb, b), q),
            _scales_as_held(pipe, kb) if holds_norms(kb) else None,
            pipe.joint_codes(vb, b),
            _scales_as_held(pipe, vb) if holds_norms(vb) else None,
            pipe.joint_head_frames(li, "v", dev),
        )
        n_exact = sum(k.shape[-2] for k in exact[0])
        bias = self._kernel_bias(mask, (b, h, rows // tq, tq), n_exact, dev, joint=True)
        args = (coded, q, *exact, bias, scaling, softcap, tq, q.dtype)
        if fused_joint_attend.usable(*args):
            return fused_joint_attend.attend(*args)
        return fused_joint_attend.attend_with_torch(*args)

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
        if holds_norms(held):
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
        if holds_norms(held):
            weights = weights * pipe.joint_scales(held)[:, :, None]
        if kernels:
            sums = pipe.value_sums(held, b, weights.reshape(b, 1, h * rows, t))
        else:  # the coordinates decoded on the device, never taken to every head per token
            sums = weights.reshape(b, h * rows, t) @ pipe.joint_codes(held, b)
        return sums.view(b, h, rows, -1) @ pipe.joint_head_frames(li, "v", dev)


def _scales_as_held(pipe: Any, held: DeviceBlocks) -> Any:
    """Each head's token scales of blocks coded across heads, for the joint attention kernels:
    their one-byte codes where the blocks are one run of equal blocks (the kernels decode them
    as they load them, one launch fewer per layer and stream), else decoded."""
    runs = held.norms.runs if held.norms is not None else ()
    if len(runs) == 1:
        return fused_joint_attend.ScaleCodes(*runs[0])
    return pipe.joint_scales(held)
