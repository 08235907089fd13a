"""Attention's per-forward memo compares the small tensors of each layer (``same_tensors.py``):
equal contents match, anything else does not, and what it holds for a device tensor leaves
with that tensor."""

from __future__ import annotations

import gc

import torch

from kakeyaturbo.hf import same_tensors
from kakeyaturbo.hf.same_tensors import same


def test_same_means_equal_shape_dtype_and_values():
    a = torch.arange(6).view(2, 3)
    assert same(a, a) and same(a, a.clone())
    assert not same(a, a.view(3, 2))
    assert not same(a, a.to(torch.int32))
    changed = a.clone()
    changed[1, 2] = 0
    assert not same(a, changed)


def test_the_host_copy_is_the_tensors_bytes_and_leaves_with_it():
    # The host-copy path is the one a GPU takes; its bytes and bookkeeping are device-free.
    t = torch.tensor([[1, 0, 3]], dtype=torch.int64)
    assert same_tensors._host_bytes(t) == t.numpy().tobytes()
    flags = torch.tensor([True, False])
    assert same_tensors._host_bytes(flags) == b"\x01\x00"
    half = torch.tensor([1.5], dtype=torch.bfloat16)
    assert same_tensors._host_bytes(half) == half.view(torch.int16).numpy().tobytes()
    keys = {id(t), id(flags), id(half)}
    assert keys <= same_tensors._HOST.keys()
    del t, flags, half
    gc.collect()
    assert not keys & same_tensors._HOST.keys()
