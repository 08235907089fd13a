"""Equality of the small tensors that attention's per-forward memo compares across layers,
without making the host wait for a device each time.

``torch.equal`` on a GPU returns a Python bool, so the host waits until the device has run
everything queued before it: once per layer and compared tensor (the sink slots are each
layer's own tensors, equal in content), which keeps the host from queueing the next layer's
work while the device runs this one's. A small device tensor is read to the host once per
tensor object instead and compared there. That holds because the tensors compared so are
replaced when they change, never changed in place (the cache's sink slots; a forward's mask).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["same"]

#: Tensors up to this many elements are read to the host once (sink slots: rows x sinks);
#: larger ones (a prefill's mask) are compared on their device.
HOST_COPY_MAX = 4096

# id(tensor) -> (a weak reference to it, its bytes on the host); an entry leaves with its tensor.
_HOST: dict[int, tuple[weakref.ref, bytes]] = {}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same shape, dtype and values."""
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.device.type == "cpu" or a.numel() > HOST_COPY_MAX:
        return torch.equal(a, b)
    return _host_bytes(a) == _host_bytes(b)


def _host_bytes(t: torch.Tensor) -> bytes:
    key = id(t)
    hit = _HOST.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    data = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    _HOST[key] = (weakref.ref(t, lambda _, k=key: _HOST.pop(k, None)), data)
    return data
