"""What every layer's attention over the codes in one forward computes alike, made once per
forward: RoPE's rotation at the coded positions, and the attention mask as an additive bias
(the sinks' coded slots masked out, their exact copies leading the exact part)."""

from __future__ import annotations

from typing import Any

import torch

from .same_tensors import same


class SharedInputs:
    """:class:`~kakeyaturbo.hf.coded_attention.CodedView`'s per-forward shared inputs (held in
    the forward's ``StepInputs.shared``)."""

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
            mh, mg = grouped_heads(bias.shape[1], h, g)
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


def grouped_heads(mask_heads: int, h: int, g: int) -> tuple[int, int]:
    """The mask's head dimension in the grouped ``[B, H, g, ...]`` layout of the scores."""
    if mask_heads == 1:
        return 1, 1
    if mask_heads == h * g:
        return h, g
    raise ValueError(f"attention mask has {mask_heads} heads, the model {h * g}")
