"""Blocks held on the model's device only: where attention over the codes reads them off the
CPU kernels (a GPU), a layer's blocks are coded there by the torch encoder
(``gpu/device_encode.py``) from its first flush on and the host keeps none."""

from __future__ import annotations

from ..gpu import device_decode
from .coded_attention import reads_on_device


class DeviceHeld:
    """Where a :class:`~kakeyaturbo.hf.layer.KakeyaLayer` holds its blocks: ``_on_device``
    (``{"k": DeviceBlocks, "v": DeviceBlocks}``, their only copy) or None (on the host)."""

    def _holds_on_device(self) -> bool:
        """Whether the layer's blocks go to its device only: where attention over the codes
        decodes them there (off the CPU kernels) and the device's decoder reads them (the
        recipes' water-filled blocks, not every ``CodecParams``). Decided at a first flush."""
        recipe, li = self._ctx.pipeline.recipe, self.layer_idx
        readable = all(device_decode.reads(recipe.params(li, s)) for s in ("k", "v"))
        return readable and reads_on_device(self.device)

    def _hold_on_device(self, added: dict[str, device_decode.DeviceBlocks]) -> None:
        """Add a flush's blocks, coded on the layer's device (attention reads them there, off
        the CPU kernels), to those it holds there: joined to the held ones; the host never
        holds them, so the codes are held once."""
        if self._on_device is not None:
            held = self._on_device
            added = {s: device_decode.DeviceBlocks.joined([held[s], added[s]]) for s in added}
        self._on_device = added
