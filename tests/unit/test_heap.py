"""`kakeyaturbo.hf.heap`: after a large flush, free heap pages go back to the OS (glibc), and a
long prompt's compression does not leave the process holding what the cache saved."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kakeyaturbo.hf import heap

pytestmark = [
    pytest.mark.skipif(not heap.available(), reason="needs glibc's malloc_trim (Linux)"),
    pytest.mark.skipif(
        "MALLOC_MMAP_THRESHOLD_" in os.environ,
        reason="a fixed mmap threshold returns large blocks at free: nothing to trim",
    ),
]

# Run in a fresh interpreter: glibc's mmap threshold is process state that earlier tests move.
FRAGMENT_THEN_TRIM = r"""
import ctypes, os, sys
from kakeyaturbo.hf import heap

MIB = 1 << 20
def rss():
    pages = int(open("/proc/self/statm").read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
# glibc raises its mmap threshold past the size of an mmapped block freed: from then on 4 MiB
# blocks come from the heap, as the encoder's temporaries do after the first layer's flush.
libc.free(libc.malloc(8 * MIB))
blocks = [libc.malloc(4 * MIB) for _ in range(32)]
for b in blocks:
    ctypes.memset(b, 1, 4 * MIB)  # resident
before = rss()
for b in blocks[::2]:  # every other one: the live ones keep the free ones from merging
    libc.free(b)
freed = rss()
small = heap.release_after(heap.TRIM_AFTER_BYTES - 1)  # a decode step's flush: no trim
after_small = rss()
large = heap.release_after(heap.TRIM_AFTER_BYTES)
print(before // MIB, freed // MIB, after_small // MIB, rss() // MIB, small, large)
"""


def test_release_after_hands_free_heap_pages_back():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT_THEN_TRIM], capture_output=True, text=True, check=True
    ).stdout.split()
    before, freed, after_small, after_large = map(int, out[:4])
    assert out[4:] == ["False", "True"]
    # 64 MiB freed inside the heap stays resident until trimmed, then goes back.
    assert freed > before - 16, "the freed blocks were not heap blocks (mmapped?)"
    assert after_small > before - 16
    assert after_large < before - 48
