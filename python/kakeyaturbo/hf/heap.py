"""Handing freed heap memory back to the operating system after a cache compresses a long span.

Compressing a long prompt frees, layer by layer, the prompt's exact keys and values and the
encoder's float32 temporaries (tens of MB per layer at 8k tokens). glibc's malloc serves blocks
of that size from ``mmap`` at first, but raises its mmap threshold to the largest block freed
(up to 32 MiB); after that they come from the heap, and free heap memory below a block still in
use is never returned. The process then keeps, as resident memory, about what the cache was
meant to save: measured on SmolLM2-135M at 8k tokens (``benches/peak_memory.py``), the peak RSS
of a ``generate`` with ``KakeyaCache`` rose by more than DynamicCache's, which holds 5x more
bytes. ``malloc_trim`` after each large flush hands the free pages back. Where malloc is not
glibc's, this module does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional

#: A flush that compressed at least this many bytes of exact keys and values trims the heap
#: after it (a prompt's flush; not the one-block flushes of decoding, whose temporaries are
#: small and whose trims would cost a walk of the heap every block_size steps for nothing).
TRIM_AFTER_BYTES = 1 << 20


def _find_malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; musl and others lack it
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def available() -> bool:
    """Whether this process's malloc can hand free heap pages back (glibc's ``malloc_trim``)."""
    return _MALLOC_TRIM is not None


def release_after(compressed_bytes: int) -> bool:
    """Hand free heap pages back to the OS after a flush that compressed ``compressed_bytes`` of
    exact tokens, if that is at least :data:`TRIM_AFTER_BYTES`. True when it trimmed."""
    if _MALLOC_TRIM is None or compressed_bytes < TRIM_AFTER_BYTES:
        return False
    _MALLOC_TRIM(0)
    return True
