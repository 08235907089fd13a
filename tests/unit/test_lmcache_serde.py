"""The ``kakeya`` LMCache serde without a store: registration, options, the container's
header and checksum, the size bound on hostile chunks (a grid, and a property over shapes,
dtypes and contents), and a fuzz of the deserializer."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


@dataclass
class _Obj:
    """What the serde reads of LMCache's ``MemoryObj``: its tensor."""

    tensor: torch.Tensor


#: Token counts at the edges: one token, around the 4 sinks, the raw ones below 16 and the
#: first coded ones, powers of two, and the chunk size (256, also the recipe's block size).
_EDGE_TOKENS = (1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 128, 255, 256)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONTENTS = ("gauss", "const", "zeros", "outlier", "alternating", "extremes", "nan", "inf")
_SCALES = st.one_of(st.sampled_from([1e-6, 1e4]), st.floats(-6, 4).map(lambda e: 10.0**e)).flatmap(
    lambda s: st.sampled_from([s, -s])
)


def _content(kind: str, tokens: int, dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """``[2, 6, tokens, 128]`` of one kind, in ``dtype`` (finite kinds clamped to its range)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 6, tokens, 128)
    top = torch.finfo(dtype).max
    if kind == "const":
        x = torch.full(shape, scale)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "alternating":  # signs flip along tokens and along channels
        sign = torch.ones(tokens, 128)
        sign[1::2] *= -1
        sign[:, 1::2] *= -1
        x = (scale * sign).expand(shape).clone()
    elif kind == "extremes":  # the dtype's largest values, both signs in every row
        x = torch.full(shape, top)
        x[..., 1::2] = -top
    else:
        x = scale * torch.randn(shape, generator=g)
        if kind == "outlier":  # one channel 100x the others, in every layer and head
            x[..., seed % 128] *= 100
        elif kind in ("nan", "inf"):
            x.view(-1)[seed % x.numel()] = float(kind)
    if kind not in ("nan", "inf"):
        x = x.clamp(-top, top)
    return x.to(dtype)


#: (tokens, dtype) -> the estimate the first example of that layout got.
_ESTIMATES: dict = {}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.one_of(st.sampled_from(_EDGE_TOKENS), st.integers(1, 256)),
    dtype=st.sampled_from(_DTYPES),
    kind=st.sampled_from(_CONTENTS),
    scale=_SCALES,
    seed=st.integers(0, 2**31 - 1),
)
def test_size_estimate_bounds_every_object(codec, tokens, dtype, kind, scale, seed):
    """LMCache allocates ``estimate_serialized_size`` bytes per object from the layout alone:
    what ``serialize`` writes must fit it for any content, and load back to the chunk's shape,
    finite (bit for bit where the chunk is stored raw). NaN and inf are refused when stored."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    import kakeyaturbo.lmcache.container as ct
    from kakeyaturbo.lmcache.serde import KakeyaDeserializer, KakeyaSerializer

    ser, de = KakeyaSerializer(codec), KakeyaDeserializer(codec)
    x = _content(kind, tokens, dtype, scale, seed)
    layout = MemoryLayoutDesc(shapes=[x.shape], dtypes=[dtype])
    bound = ser.estimate_serialized_size(layout)
    again = MemoryLayoutDesc(shapes=[torch.Size([2, 6, tokens, 128])], dtypes=[dtype])
    assert ser.estimate_serialized_size(again) == bound
    assert _ESTIMATES.setdefault((tokens, dtype), bound) == bound  # whatever the content
    # Room past the bound, so that an overflow is measured here rather than refused.
    dst = _Obj(torch.zeros(2 * x.numel() * x.element_size() + 4096, dtype=torch.uint8))
    if kind in ("nan", "inf"):
        with pytest.raises(ValueError, match="NaN or infinite"):
            ser.serialize(_Obj(x), dst, None)
        return
    n = ser.serialize(_Obj(x), dst, None)
    assert n <= bound
    assert ser.estimate_serialized_size(layout) == bound
    written = dst.tensor[:n]
    h = ct.unpack(memoryview(written.numpy()))[0]
    assert not written[ct.OVERHEAD + h.payload_len :].any()  # past the object: zero padding
    out = _Obj(torch.full_like(x, float("nan")))  # a value left unwritten would show
    de.deserialize(_Obj(written), out, None)
    assert out.tensor.shape == x.shape and out.tensor.dtype == dtype
    if h.mode == ct.MODE_RAW:
        assert torch.equal(out.tensor.view(torch.uint8), x.view(torch.uint8))
    else:
        assert torch.isfinite(out.tensor.float()).all()


def test_forged_fallback_past_the_dtype_is_refused(codec):
    import struct

    import kakeyaturbo.lmcache.container as ct
    from kakeyaturbo.lmcache import KakeyaFormatError

    # Fallback rows whose float32 minimum is past bfloat16's range: infinite once in the chunk.
    shape, values = (2, 6, 16, 128), 2 * 6 * 16 * 128
    rows = values // 64
    payload = bytes(values * 2 // 8) + struct.pack("<ff", 3.4e38, 0.0) * rows
    head = ct.Header(ct.MODE_FALLBACK, "bfloat16", shape, 2, 64, 2, 0, len(payload))
    with pytest.raises(KakeyaFormatError, match="non-finite"):
        codec.decode(memoryview(ct.pack(head, payload)), torch.empty(shape, dtype=torch.bfloat16))


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
