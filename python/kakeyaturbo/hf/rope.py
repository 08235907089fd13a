"""Rotary position embedding and its exact inverse, in both pairings: half-split (Llama,
Qwen, Mistral, Gemma: channel ``i`` with ``i + d/2``) and adjacent-pair (GPT-J, CodeGen, GLM:
channel ``2i`` with ``2i + 1``), chosen from the config's ``model_type``.

A RoPE key is ``k_rot = k * cos(p w) + rotate_half(k) * sin(p w)``: each pair of channels
``(i, i + d/2)`` is turned by the angle ``p * w_i``. The inverse is the same rotation with
``-sin``. Keys stored pre-RoPE ("pre-RoPE mode") are turned back by the angle of the position
they were written at before encoding and turned forward again after decoding, so the codec
sees position-free keys whose statistics (and future calibrations) do not drift with position.

Angles are formed exactly as transformers forms them (``float32(position) * float32(w)``), so
``unrotate`` undoes the model's own rotation to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

_SUPPORTED_ROPE_TYPES = ("default", "linear")
#: Model types that pair adjacent channels (``rotate_every_two``) instead of halves.
ADJACENT_PAIR_MODEL_TYPES = ("gptj", "codegen", "glm", "chatglm", "glm4")


@dataclass(frozen=True)
class RotarySpec:
    """Inverse frequencies of one layer type's RoPE."""

    inv_freq: torch.Tensor  # [rot_dim // 2], float32
    rot_dim: int  # channels rotated (head_dim unless partial_rotary_factor < 1)
    adjacent_pairs: bool = False  # GPT-J/GLM pairing (2i, 2i+1) instead of (i, i + d/2)

    def cos_sin(
        self, positions: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each pair's angle at integer ``positions`` [B, T]:
        [B, 1, T, rot_dim // 2] float32 (reusable by every layer of this RoPE)."""
        freqs = positions.to(device=device, dtype=torch.float32)[..., None] * self.inv_freq.to(
            device
        )
        return freqs.cos()[:, None], freqs.sin()[:, None]

    def _apply(self, x: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"expected keys shaped [batch, heads, tokens, head_dim], got {tuple(x.shape)}"
            )
        if positions.shape != (x.shape[0], x.shape[2]):
            raise ValueError(
                f"positions {tuple(positions.shape)} do not match keys {tuple(x.shape)}"
            )
        return self.turn(x, *self.cos_sin(positions, x.device), sign)

    def turn(self, x: torch.Tensor, c: torch.Tensor, s_: torch.Tensor, sign: float = 1.0):
        """Rotate ``x`` [B, H, T, D] by the angles of :meth:`cos_sin` (``sign`` -1: undo)."""
        rot, rest = x[..., : self.rot_dim].float(), x[..., self.rot_dim :]
        half = self.rot_dim // 2
        if self.adjacent_pairs:
            s_ = s_ * sign  # exact: sign is +-1
            # Pair (2i, 2i+1) turns by angle p * w_i: the same rotation, other channel order.
            even, odd = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((even * c - odd * s_, odd * c + even * s_), dim=-1).flatten(-2)
            return torch.cat((out.to(x.dtype), rest), dim=-1) if rest.shape[-1] else out.to(x.dtype)
        # Pair (i, i + d/2): k * cos + rotate_half(k) * sin, written into one output (a
        # concatenation of the halves costs several times the arithmetic).
        first, second = rot[..., :half], rot[..., half:]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        torch.mul(first, c, out=out[..., :half]).addcmul_(second, s_, value=-sign)
        torch.mul(second, c, out=out[..., half : self.rot_dim]).addcmul_(first, s_, value=sign)
        if rest.shape[-1]:
            out[..., self.rot_dim :] = rest
        return out.to(x.dtype)

    def paired_order(self, head_dim: int) -> torch.Tensor:
        """The channel order ``[head_dim]`` that puts each rotated pair side by side (``i``,
        ``i + rot_dim/2``, ...), the unrotated channels after: the layout
        :meth:`turn_paired` works in. A dot product of two vectors is the same in it."""
        half = self.rot_dim // 2
        if self.adjacent_pairs:
            return torch.arange(head_dim)
        pairs = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()
        return torch.cat((pairs, torch.arange(self.rot_dim, head_dim)))

    def split_order(self, head_dim: int) -> torch.Tensor | None:
        """The channel order that puts each rotated pair at ``(i, i + rot_dim/2)``, the
        unrotated channels after (None: the model's own order already does, as half-split
        RoPE's does): the layout of the codec's attention kernel (``coded_key_logits``)."""
        if not self.adjacent_pairs:
            return None
        return torch.cat(
            (
                torch.arange(0, self.rot_dim, 2),
                torch.arange(1, self.rot_dim, 2),
                torch.arange(self.rot_dim, head_dim),
            )
        )

    def split_rotation(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """cos, then sin, of each pair's angle at ``positions`` [B, T]: [B, T, 2, rot_dim //
        2] float32, the rotation ``coded_key_logits`` takes."""
        c, s_ = self.cos_sin(positions, device)
        return torch.stack((c[:, 0], s_[:, 0]), dim=-2)

    def rotation(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``cos + i sin`` of each pair's angle at ``positions`` [B, T]: [B, 1, T, rot_dim //
        2] complex64, for :meth:`turn_paired`."""
        return torch.complex(*self.cos_sin(positions, device))

    def turn_paired(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """RoPE on float32 ``x`` [B, H, T, D] whose channels are in :meth:`paired_order`, in
        place: each pair is one complex number turned by one complex product (several times
        cheaper than :meth:`turn` on the halves)."""
        pairs = x[..., : self.rot_dim].unflatten(-1, (self.rot_dim // 2, 2))
        torch.view_as_complex(pairs).mul_(rotation)
        return x

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to ``x`` [B, H, T, D] at integer ``positions`` [B, T]."""
        return self._apply(x, positions, 1.0)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo RoPE: ``unrotate(rotate(x, p), p) == x`` up to float rounding."""
        return self._apply(x, positions, -1.0)


def rotary_spec_from_config(
    config: PretrainedConfig, layer_type: str = "full_attention"
) -> RotarySpec:
    """Build the RoPE of ``layer_type`` layers from a (text) config.

    Supports the ``default`` and ``linear`` rope types with ``rope_theta`` and an optional
    ``partial_rotary_factor``; other types (llama3, yarn, longrope, dynamic, ...) raise
    ``NotImplementedError`` because their exact inverse is not implemented yet.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]  # Gemma 3 style: one RoPE per layer type
    if not params:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise ValueError(
                "pre_rope needs a RoPE model: the config has neither rope_parameters nor rope_theta"
            )
        params = {"rope_type": "default", "rope_theta": theta}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"pre_rope supports rope types {_SUPPORTED_ROPE_TYPES}; this model uses {rope_type!r}"
        )
    if "rope_theta" not in params:
        raise ValueError("pre_rope: rope_parameters has no rope_theta")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = (
        params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    )
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"pre_rope: rotary dimension {dim} is invalid for head_dim {head_dim}")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (
        base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    )
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    adjacent = getattr(config, "model_type", "") in ADJACENT_PAIR_MODEL_TYPES
    return RotarySpec(inv_freq=inv_freq, rot_dim=dim, adjacent_pairs=adjacent)


class ModelRope:
    """Every layer's RoPE of a model (Gemma 3 style models have one per layer type):
    ``rope(layer)`` -> :class:`RotarySpec`, built once per layer."""

    def __init__(self, config: PretrainedConfig) -> None:
        from .layer_plan import attention_kinds, text_config

        self._config = text_config(config)
        self._types = attention_kinds(self._config)
        self._specs: dict[int, RotarySpec] = {}

    def __call__(self, layer: int) -> RotarySpec:
        # One table per layer, so a cache layer can hold (and count) its own.
        if layer not in self._specs:
            self._specs[layer] = rotary_spec_from_config(self._config, self._types[layer])
        return self._specs[layer]

    def unrotate(self, x: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        """Undo RoPE on ``x`` [B, H, T, D] whose token ``i`` sits at position ``start + i``."""
        return self(layer).unrotate(x, _span(x, start))

    def rotate(self, x: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        return self(layer).rotate(x, _span(x, start))


def _span(x: torch.Tensor, start: int) -> torch.Tensor:
    pos = torch.arange(start, start + x.shape[2], dtype=torch.int32, device=x.device)
    return pos.expand(x.shape[0], -1)
