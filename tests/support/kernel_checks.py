"""The check every fused kernel's tests make: a kernel that fails or disagrees with its torch
twin on a device is dropped there with a warning, and one that agrees is kept.

``CheckedKernel.agrees`` runs the check it is given on any device, so these run on the CPU
with stand-ins for the kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def broken(*_args: Any) -> Any:
    """A kernel that fails to build or launch."""
    raise RuntimeError("no such device function")


def assert_dropped_unless_it_agrees(
    agrees: Callable[[Callable], bool], name: str, wrong: Callable, right: Callable
) -> None:
    """``agrees(stand_in)`` runs the kernel's check with ``stand_in`` as the kernel: a broken
    one fails with a warning (``"{name} failed on cpu"``), ``wrong`` disagrees with a warning,
    ``right`` passes."""
    with pytest.warns(RuntimeWarning, match=f"{name} failed on cpu"):
        assert not agrees(broken)
    with pytest.warns(RuntimeWarning, match=f"{name} disagrees"):
        assert not agrees(wrong)
    assert agrees(right)


def assert_twin_checked(
    monkeypatch, module: Any, attr: str, kernel: Any, device, check: Callable[[], bool], twin
) -> None:
    """The same for a kernel ``module.attr`` whose check is ``check()`` on ``device``, with
    the torch twin as the right stand-in and its output off by 1% as the wrong one."""

    def agrees(stand_in) -> bool:
        monkeypatch.setattr(module, attr, stand_in)
        return kernel.agrees(device, check)

    wrong = lambda *a: twin(*a) * 1.01  # noqa: E731
    assert_dropped_unless_it_agrees(agrees, kernel.name, wrong, twin)
