"""The ``kakeya`` LMCache serde without a store: registration, options, the container's
header and checksum, the size bound on hostile chunks, and a fuzz of the deserializer."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from lmcache_chunks import KINDS, hostile_chunk, ref_codec
from lmcache_env import require_lmcache


@pytest.fixture(scope="module", autouse=True)
def _lmcache():
    require_lmcache()


@pytest.fixture(scope="module")
def codec(joint_bundle):
    return ref_codec(joint_bundle, chunk_size=256, max_positions=1024)


def test_registered_with_lmcache():
    from lmcache.v1.distributed.serde import get_registered_serde_types

    import kakeyaturbo.lmcache as klm

    assert klm.register() == "kakeya"
    assert "kakeya" in get_registered_serde_types()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, "missing required"),
        ({"bogus": 1}, "unknown options"),
        ({"num_layers": 0}, "positive integer"),
        ({"rope_theta": None}, "exactly one of rope_theta and model"),
        ({"budget_bits": 40}, "budget_bits"),
    ],
)
def test_options_rejected(bad, match):
    from kakeyaturbo.lmcache.options import SerdeOptions

    kw = {"bundle": "x", "num_layers": 6, "num_kv_heads": 2, "head_dim": 64, "rope_theta": 1e4}
    kw = {} if bad == {} else {**kw, **bad}
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        SerdeOptions.from_kwargs(kw)


def test_wrong_geometry_is_a_clear_error(codec):
    with pytest.raises(ValueError, match="kv_heads\\*head_dim=128"):
        codec.size_bound((2, 6, 256, 96), torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 100, 256, 300])
def test_size_bound_holds_on_hostile_chunks(codec, kind, tokens):
    x = hostile_chunk(kind, tokens, seed=tokens)
    data = codec.encode(x)
    assert len(data) == codec.size_bound(tuple(x.shape), x.dtype)  # padded to it exactly
    out = torch.empty_like(x)
    codec.decode(memoryview(data), out)
    assert torch.isfinite(out.float()).all()


def test_real_chunk_round_trip_is_close(codec, real_kv):
    k = torch.stack([torch.as_tensor(real_kv[f"layer{i}.k"]) for i in range(6)])  # post-RoPE
    v = torch.stack([torch.as_tensor(real_kv[f"layer{i}.v"]) for i in range(6)])
    # Chunk 2 of the sequence: tokens 512..767, LMCache's [2, L, T, H*D] layout.
    kv = torch.stack([k, v])[:, :, :, 512:768].permute(0, 1, 3, 2, 4).reshape(2, 6, 256, 128)
    kv = kv.bfloat16()
    assert codec.find_start(kv.float()) == 512
    data = codec.encode(kv)
    out = torch.empty_like(kv)
    codec.decode(memoryview(data), out)
    rel = float((out.float() - kv.float()).norm() / kv.float().norm())
    assert rel < 0.25
    assert len(data) * 4 <= kv.numel() * 2


def _corrupt(data: bytes, rng: torch.Generator) -> bytes:
    import kakeyaturbo.lmcache.container as ct

    b = bytearray(data)
    op = int(torch.randint(0, 4, (1,), generator=rng))
    if op == 0:  # truncated
        return bytes(b[: int(torch.randint(0, len(b), (1,), generator=rng))])
    for _ in range(int(torch.randint(1, 9, (1,), generator=rng))):
        i = int(torch.randint(0, len(b), (1,), generator=rng))
        b[i] ^= 1 << int(torch.randint(0, 8, (1,), generator=rng))
    if op >= 2:  # forged: the checksum recomputed over the flipped bytes
        h = ct.unpack(memoryview(data))[0]
        end = ct.HEADER_BYTES + h.payload_len
        if op == 3:  # and the header's fields forged too
            i = int(torch.randint(4, ct.HEADER_BYTES, (1,), generator=rng))
            b[i] = int(torch.randint(0, 256, (1,), generator=rng))
        b[end : end + 4] = zlib.crc32(bytes(b[:end])).to_bytes(4, "little")
    return bytes(b)


def fuzz_deserializer(codec, cases: int, seed: int = 0) -> dict:
    """``cases`` corrupted objects, each a clean ``KakeyaFormatError`` or a finite chunk of
    the right shape; returns the counts."""
    from kakeyaturbo.lmcache import KakeyaFormatError

    rng = torch.Generator().manual_seed(seed)
    bases = [codec.encode(hostile_chunk(k, t, 3)) for k, t in (("gauss", 256), ("heavy", 40))]
    bases.append(codec.encode(hostile_chunk("gauss", 8, 1)))  # a raw-mode object
    counts = {"rejected": 0, "decoded": 0}
    for i in range(cases):
        base = bases[i % len(bases)]
        data = _corrupt(base, rng)
        t = ct_tokens(base)
        out = torch.zeros(2, 6, t, 128, dtype=torch.bfloat16)
        try:
            codec.decode(memoryview(data), out)
        except KakeyaFormatError:
            counts["rejected"] += 1
            continue
        assert torch.isfinite(out.float()).all()
        counts["decoded"] += 1
    return counts


def ct_tokens(data: bytes) -> int:
    import kakeyaturbo.lmcache.container as ct

    return ct.unpack(memoryview(data))[0].shape[2]


def test_fuzz_deserializer(codec):
    # KAKEYATURBO_SERDE_FUZZ_CASES=100000 for the long run (docs/lmcache.md)
    cases = int(os.environ.get("KAKEYATURBO_SERDE_FUZZ_CASES", "600"))
    counts = fuzz_deserializer(codec, cases)
    assert counts["rejected"] > cases // 2  # truncations and bare flips are all caught by the CRC
