"""What the package's Triton kernels share: Triton itself where it imports, and the rule that
a kernel serves a device only once its first call there agreed with the torch ops it replaces.

The kernels (``fused_decode.py``, ``fused_encode.py`` with ``encode_kernels.py``,
``fused_norm_encode.py``, ``fused_attention.py``, ``fused_joint_attend.py`` with
``joint_attend_kernels.py``, ``fused_int8_rows.py``) run where the model
does, on CUDA devices; nothing here imports the rest of the package (no import cycle), so any
module may use it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # not installed (CPU-only torch builds) or broken: torch ops instead
    triton = None
    tl = None

__all__ = [
    "CheckedKernel",
    "bf16_bits",
    "checked_kernels",
    "program_tile",
    "round_half_even",
    "tl",
    "triton",
    "within_tolerance",
]

_EVERY: list[CheckedKernel] = []


class CheckedKernel:
    """A kernel's standing per device. :meth:`usable` runs ``check`` (the kernel's output and
    the torch ops' on the same inputs, and whether they agree) on the first call for each
    device; a kernel that fails to build or launch there, or disagrees, is not used there
    again in this process, with a ``RuntimeWarning``, and the torch ops run instead."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._checked: dict[str, bool] = {}
        _EVERY.append(self)

    def usable(self, device: torch.device, check: Callable[[], bool]) -> bool:
        """Whether the kernel runs on ``device``: a CUDA device, with Triton, not turned off
        by ``KAKEYATURBO_TRITON=0``, and ``check()`` passed there (run once per device: it
        waits for the device)."""
        if not self.runs_on(device):
            return False
        key = str(device)
        if key not in self._checked:
            self._checked[key] = self.agrees(device, check)
        return self._checked[key]

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        """Whether kernels may run on ``device`` at all: CUDA, Triton, not turned off."""
        off = os.environ.get("KAKEYATURBO_TRITON") == "0"
        return triton is not None and device.type == "cuda" and not off

    def pending(self, device: torch.device) -> bool:
        """Whether the next :meth:`usable` on ``device`` runs the check."""
        return self.runs_on(device) and str(device) not in self._checked

    def agrees(self, device: torch.device, check: Callable[[], bool]) -> bool:
        """``check()``, with a failure to run counted as disagreement and either said."""
        try:
            same = check()
        except Exception as err:  # a build or launch failure on this device: say so, go on
            warnings.warn(
                f"kakeyaturbo: the Triton {self.name} failed on {device} ({err!r}); "
                "using torch ops",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        if not same:
            warnings.warn(
                f"kakeyaturbo: the Triton {self.name} disagrees with the torch ops on "
                f"{device}; using torch ops",
                RuntimeWarning,
                stacklevel=4,
            )
        return same

    def standing(self) -> dict[str, str]:
        """Per device checked so far, ``"used"`` or ``"dropped"`` (for benches' reports)."""
        return {dev: "used" if ok else "dropped" for dev, ok in self._checked.items()}


def checked_kernels() -> tuple[CheckedKernel, ...]:
    """Every kernel's standing made so far (one per kernel of the modules imported)."""
    return tuple(_EVERY)


def within_tolerance(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Whether ``got`` is ``want`` to ``tolerance`` of the largest of ``want`` (a kernel whose
    sums run in another order than torch's), shapes equal and ``got`` finite."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    scale = want.abs().max().item() if want.numel() else 0.0
    return bool(((got - want).abs() <= tolerance * scale).all())


if triton is not None:

    @triton.jit
    def bf16_bits(x):
        """float32 ``x`` rounded to bfloat16, to nearest even, as its 16 bits (in uint32), as
        torch rounds (subnormals included; Triton's interpreter truncates in a cast); NaN is a
        quiet NaN."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, bits)

    @triton.jit
    def round_half_even(x):
        """float32 ``x`` (``|x| < 2**22``) rounded to an integer, ties to even, as
        ``torch.round``: adding and taking away 1.5 * 2^23 leaves the integer, exactly."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def program_tile(BLOCK: tl.constexpr):
        """This program's index along the launch's first axis (int64: a batch row, a stream)
        and its tile of ``BLOCK`` consecutive indices along the second."""
        return tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)

else:
    bf16_bits = None
    program_tile = None
    round_half_even = None
