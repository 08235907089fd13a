"""A model's weights in float32 for the length of a fit. The auto bundle is shared by a
checkpoint's float32 and bfloat16 copies (``auto.auto_bundle_dir``), so it is fitted in float32
whichever copy asks first: fitted in bfloat16, its sensitivity scan measures the model's own
rounding beside the codec's, and on SmolLM2 the bundle lost a factor 1.7 in KL (8 passages).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain

import torch

_NARROW = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def in_float32(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with its bfloat16 and float16 parameters and buffers in float32 inside the
    block, each back in its own dtype after (exactly: both widen to float32 without loss), also
    when the block raises. In place: the model holds the float32 copy meanwhile."""
    narrow = [
        (t, t.dtype)
        for t in chain(model.parameters(), model.buffers())
        if t.is_floating_point() and t.dtype in _NARROW
    ]
    try:
        for t, _ in narrow:
            t.data = t.data.float()
        yield model
    finally:
        for t, dtype in narrow:
            t.data = t.data.to(dtype)
