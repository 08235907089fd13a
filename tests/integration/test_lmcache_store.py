"""Real KV (kt-ref-a's, post-RoPE) through LMCache's own file-system adapter and a real Redis
server (started here on loopback) with the ``kakeya`` serde: stored, counted on the store,
loaded back; a corrupted stored object is a miss, not garbage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lmcache_chunks import KT_REF_A
from lmcache_env import require_lmcache, require_redis


@pytest.fixture(scope="module", autouse=True)
def _lmcache():
    require_lmcache()


@pytest.fixture(scope="module")
def chunks(real_kv):
    from lmcache_harness import split_chunks

    k = torch.stack([torch.as_tensor(real_kv[f"layer{i}.k"]) for i in range(6)])
    v = torch.stack([torch.as_tensor(real_kv[f"layer{i}.v"]) for i in range(6)])
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, 6, k.shape[2], 128)
    return split_chunks(kv[:, :, :1024].bfloat16(), 256)


def _serde(bundle) -> dict:
    return {"type": "kakeya", "bundle": str(bundle), **KT_REF_A, "max_positions": 1024}


def _round_trip(spec, chunks, salt: bytes):
    from lmcache_harness import Tier, chunk_keys

    tier = Tier(spec)
    try:
        keys = chunk_keys(len(chunks), "kt-ref-a", salt)
        tier.store(dict(zip(keys, chunks)))
        return keys, tier.load(keys, chunks[0].shape, chunks[0].dtype), tier
    finally:
        tier.close()


def _check(chunks, loaded, stored_bytes, bundle):
    from lmcache_chunks import ref_codec

    bound = ref_codec(bundle, max_positions=1024).size_bound(tuple(chunks[0].shape), torch.bfloat16)
    assert stored_bytes == len(chunks) * bound  # the adapter keeps the whole fixed-size object
    assert sum(c.numel() * 2 for c in chunks) >= 4 * stored_bytes
    for c, got in zip(chunks, loaded):
        assert got is not None
        rel = float((got.float() - c.float()).norm() / c.float().norm())
        assert rel < 0.25


def test_fs_adapter_round_trip_and_corruption_is_a_miss(tmp_path, chunks, joint_bundle):
    from lmcache_harness import Tier, dir_bytes

    spec = {"type": "fs", "base_path": str(tmp_path), "serde": _serde(joint_bundle)}
    keys, loaded, _ = _round_trip(spec, chunks, b"fs")
    _check(chunks, loaded, dir_bytes(tmp_path), joint_bundle)
    files = sorted(p for p in Path(tmp_path).rglob("*") if p.is_file())
    data = bytearray(files[0].read_bytes())
    data[len(data) // 3] ^= 0x10
    files[0].write_bytes(bytes(data))
    tier = Tier(spec)
    try:
        again = tier.load(keys, chunks[0].shape, chunks[0].dtype)
    finally:
        tier.close()
    assert sum(a is None for a in again) >= 1  # LMCache's wrapper fails the load: a miss


def test_redis_adapter_round_trip(chunks, joint_bundle):
    from lmcache_harness import RedisServer

    with RedisServer(require_redis()) as server:
        spec = {
            "type": "resp",
            "host": "127.0.0.1",
            "port": server.port,
            "serde": _serde(joint_bundle),
        }
        _, loaded, _ = _round_trip(spec, chunks, b"redis")
        _check(chunks, loaded, server.value_bytes(), joint_bundle)
