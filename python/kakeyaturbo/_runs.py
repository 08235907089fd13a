"""Runs of consecutive items of equal length, which the decoders batch into one call each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def equal_runs(items: Sequence[T], length: Callable[[T], int]) -> list[Sequence[T]]:
    """``items`` split, in order, wherever ``length`` changes (a cache's blocks are one run;
    an evaluation's last, shorter block is a second)."""
    runs, i = [], 0
    while i < len(items):
        j = i + 1
        while j < len(items) and length(items[j]) == length(items[i]):
            j += 1
        runs.append(items[i:j])
        i = j
    return runs
