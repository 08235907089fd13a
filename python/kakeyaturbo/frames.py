"""Coding frames: the per-(layer, head) basis the pipeline codes K/V in (a calibration bundle's,
or a PCA frame fitted on the first tokens coded and held once as float16), the frames across
heads of a bundle fitted with ``--joint-heads``, and RoPE undone or redone around them."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .coded_block import STREAMS
from .norm_codes import scaled_norms

#: Self-fitted frames need at least this many tokens per dimension to pay for themselves.
MIN_FRAME_TOKENS_PER_DIM = 4
_IDENTITY = torch.empty(0, dtype=torch.float16)  # "no frame": a sequence too short for one


def fits_frame(x: torch.Tensor) -> bool:
    """Whether ``x`` [B, H, T, D] gets a self-fitted frame: a frame is D x D per head, and on
    fewer than MIN_FRAME_TOKENS_PER_DIM * D tokens it costs more than it saves (the sequence is
    coded in the identity frame)."""
    b, _, t, d = x.shape
    return b * t >= MIN_FRAME_TOKENS_PER_DIM * d


def _fit_frame(x: torch.Tensor) -> torch.Tensor:
    """Per-head PCA frames ``[H, D, D]`` float16 (columns by descending variance) of ``x``
    [B, H, T, D]: held as float16, used as float32."""
    b, h, t, d = x.shape
    xs = x.double().permute(1, 0, 2, 3).reshape(h, b * t, d)
    xs = xs - xs.mean(1, keepdim=True)
    cov = xs.transpose(1, 2) @ xs / max(b * t, 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending
    return vecs.flip(-1).half().contiguous()


class Frames:
    """:class:`~kakeyaturbo.pipeline.Pipeline`'s frames: its calibration's transforms
    (``_transforms``) or its self-fitted frames (``_frames``, by (layer, stream))."""

    def frame_bytes(self, layer: Optional[int] = None) -> int:
        """Bytes of the self-fitted frames held (for ``layer``, or all layers)."""
        return sum(
            f.numel() * f.element_size()
            for (li, _), f in self._frames.items()
            if layer in (None, li)
        )

    def forget(self, layer: int) -> None:
        """Drop ``layer``'s self-fitted frames and token-norm choice (its cache layer was reset:
        the next sequence makes its own)."""
        for stream in STREAMS:
            self._frames.pop((layer, stream), None)
        self.token_norms.forget(layer)

    def _decide_norms(self, x, layer: int, stream: str, positions, sinks) -> None:
        """Make ``layer``'s ``stream``'s token-norm choice on ``x`` ``[B, H, T, D]`` if it is not
        made yet, in the bundle's coding frame where there is one (it may weigh channels:
        ``value_channel_scales``) and the tokens are in its space (not keys still rotated)."""
        into = None
        rotated = positions is not None and stream == "k" and self.recipe.pre_rope
        if self._transforms is not None and not rotated:
            t = self._transforms
            into = lambda v: t.forward(v.float(), layer, stream)  # noqa: E731
        self.token_norms.decide(x, layer, stream, sinks, into)

    def _joints(self, layers: list[int], stream: str, device: torch.device) -> torch.Tensor:
        """The frames across heads of ``layers`` ``[L, H*D, H*D]`` on ``device``."""
        t = self._transforms
        assert t is not None  # a recipe across heads needs a bundle (checked when built)
        if len(layers) == 1:
            return t.on(self._joint(layers[0], stream), (layers[0], stream, "joint"), device)[None]
        return t.stacked(layers, stream, "joint", device)

    def _heads(self, coded, layers: list[int], stream: str, heads: int) -> torch.Tensor:
        """Blocks coded across heads, their decoded codes ``coded`` ``[L, B, T, H*D]`` (of
        ``layers``) -> each head's coding-frame coordinates ``[L, B, H, T, D]``."""
        n, b, t, _ = coded.shape
        inverse = self._joints(layers, stream, coded.device).transpose(-1, -2)
        # One layer by one matrix product, as a decode of its blocks alone computes it.
        y = coded[0] @ inverse[0] if n == 1 else coded @ inverse[:, None]
        return y.view(n, b, t, heads, -1).permute(0, 1, 3, 2, 4)

    def _head_scales(self, coded, layers: list[int], stream: str, norms) -> torch.Tensor:
        """Each head's scale ``[L, B, H, T]`` float16 of ``layers``' blocks coded across heads
        (their decoded codes ``coded`` ``[L, B, T, H*D]``; the tokens' norms ``norms``
        ``[L, B, H, T]``): its norm over the norm of its decoded unit vector (the decoder
        multiplies by it and divides by nothing)."""
        return scaled_norms(norms, self._head_norms(coded, layers, stream, norms.shape[2]))

    def _head_norms(self, coded, layers: list[int], stream: str, heads: int) -> torch.Tensor:
        """The norms ``[L, B, H, T]`` of each head's decoded unit vector (:meth:`_heads`)."""
        return self._heads(coded, layers, stream, heads).norm(dim=-1)

    def joint_frame(
        self,
        layer: int,
        stream: str,
        order: Optional[tuple[Any, torch.Tensor]] = None,
        device: Optional[torch.device] = None,
    ) -> torch.Tensor:
        """``[H*D, H*D]`` float32 ``M``: the coordinates ``y`` of blocks coded across heads go
        to the heads' ``x`` side by side (pre-RoPE keys, values) as ``y @ M`` (before each
        head's scale, for streams with token norms). ``order``: ``(name, columns)``, ``M``'s
        columns in that order (attention's RoPE layout), made once per name too. On
        ``device`` (default: the CPU; copied there once per bundle)."""
        # Bundle data: made once per bundle, held by it and shared by every cache and sequence
        # (a cache holding its own would hold 8.8 MB more on SmolLM2).
        derived, key = self.calibration.derived, ("joint frame", layer, stream)
        if key not in derived:
            inv = self._transforms.matrix(layer, stream, "inv")  # type: ignore[union-attr]
            derived[key] = self._joint(layer, stream).T @ torch.block_diag(*inv)
        if order is not None:
            name, columns = order
            if (key, name) not in derived:
                derived[(key, name)] = derived[key].index_select(-1, columns.cpu())
            key = (key, name)
        return self._bundle_on(derived[key], key, device)

    def joint_head_frames(
        self, layer: int, stream: str, device: Optional[torch.device] = None
    ) -> torch.Tensor:
        """:meth:`joint_frame` split by head, ``[H, H*D, D]``: head ``h``'s ``x`` is ``y @
        frames[h]`` (contiguous, as the codec's kernels read it; bundle data, made once), on
        ``device`` (default: the CPU)."""
        derived, key = self.calibration.derived, ("joint head frames", layer, stream)
        if key not in derived:
            frame = self.joint_frame(layer, stream)
            heads = len(self._transforms.matrix(layer, stream, "inv"))  # type: ignore[union-attr]
            derived[key] = frame.view(frame.shape[0], heads, -1).transpose(0, 1).contiguous()
        return self._bundle_on(derived[key], key, device)

    def _bundle_on(self, m: torch.Tensor, key: tuple, device: Optional[torch.device]):
        """``m`` (bundle data named ``key``) on ``device``, copied there once per bundle."""
        if device is None:
            return m
        return self._transforms.on(m, key, torch.device(device))  # type: ignore[union-attr]

    def frame_inverse(
        self, layer: int, stream: str, device: Optional[torch.device] = None
    ) -> Optional[torch.Tensor]:
        """``[H, D, D]`` float32 ``M`` with ``x = y @ M`` for the frame coordinates ``y`` of
        :meth:`decode_frame` (None: the identity frame), on ``device`` (default: the CPU; a
        bundle's copy there is made once per bundle)."""
        if self.recipe.joint(stream):
            raise ValueError("blocks coded across heads (joint_heads): see joint_frame")
        if self._transforms is not None:
            m = self._transforms.matrix(layer, stream, "inv")
            return m if device is None else self._transforms.on(m, (layer, stream, "inv"), device)
        frame = self._frames[(layer, stream)]
        if not frame.numel():
            return None
        m = frame.float().transpose(-1, -2)
        return m if device is None else m.to(device)

    def _into_frame(self, x, layer, stream):
        """``x`` ``[B, H, T, D]`` of ``layer`` into its coding frame."""
        if self._transforms is not None:
            return self._transforms.forward(x, layer, stream)
        frame = self._frame_for(x, layer, stream)
        if not frame.numel():  # the identity frame
            return x
        return torch.einsum("bhtd,hde->bhte", x, frame.float().to(x.device))

    def _into_frames(self, x, layers, stream):
        """``x`` ``[L, B, H, T, D]`` of ``layers`` into their coding frames, by one product
        for them all (each layer's the same as :meth:`_into_frame` gives)."""
        if len(layers) == 1:
            return self._into_frame(x[0], layers[0], stream)[None]
        if self._transforms is not None:
            return self._transforms.forward_layers(x, layers, stream)
        frames = [self._frame_for(x[i], layer, stream) for i, layer in enumerate(layers)]
        if not frames[0].numel():  # the identity frame (alike layers share its kind)
            return x
        return torch.einsum("lbhtd,lhde->lbhte", x, torch.stack(frames).float().to(x.device))

    def _frame_for(self, x, layer, stream) -> torch.Tensor:
        """``layer``'s self-fitted frame, fitted on ``x`` ``[B, H, T, D]`` if it has none."""
        frame = self._frames.get((layer, stream))
        if frame is None:
            frame = self._frames[(layer, stream)] = _fit_frame(x) if fits_frame(x) else _IDENTITY
        return frame

    def _from_frame(self, y, layer, stream, positions):
        if self._transforms is not None:
            x = self._transforms.inverse(y, layer, stream)
        else:
            # The frame is float16-rounded, so its transpose is its inverse only to ~1e-3; the
            # encoder projected with the same matrix, so the round trip stays consistent.
            m = self.frame_inverse(layer, stream, y.device)
            x = y if m is None else y @ m
        if positions is not None and stream == "k" and self.recipe.pre_rope:
            x = self._rope_for(layer).rotate(x, positions)
        return x

    def _joint(self, layer: int, stream: str) -> torch.Tensor:
        return self._transforms.joint(layer, stream)  # type: ignore[union-attr]

    def _rope_for(self, layer: int):
        if self._rope is None:
            raise ValueError("pre-RoPE recipe: keys with positions need the model's RoPE")
        return self._rope(layer)
