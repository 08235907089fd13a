"""Bad input gets a clear Python exception naming the problem; hostile bytes always raise
FormatError (never a crash, a hang or a huge allocation)."""

from __future__ import annotations

import pickle
import struct
import zlib

import numpy as np
import pytest
import torch

import kakeyaturbo as kt

X = np.random.default_rng(0).standard_normal((300, 32)).astype(np.float32)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (X.astype(np.int32), TypeError, "x: dtype int32"),
        (torch.from_numpy(X).int(), TypeError, "x: dtype torch.int32"),
        ([[1.0, 2.0]], TypeError, "x: expected a numpy array"),
        (X[0], ValueError, "x: expected 2 dimensions"),
        (X[None], ValueError, "x: expected 2 dimensions"),
        (X[:0], ValueError, "x: empty"),
    ],
)
def test_bad_arrays(bad, exc, match):
    with pytest.raises(exc, match=match):
        kt.encode_layer(bad)


def test_float64_is_coded_as_its_float32_copy():
    """numpy's default dtype is accepted: converted to float32, it gives the float32 copy's
    bytes, and decodes to float32."""
    x64 = X.astype(np.float64)
    p = kt.CodecParams(bit_width=3, block_size=128)
    a, b = kt.encode_layer(x64, p), kt.encode_layer(X, p)
    assert a.to_bytes() == b.to_bytes()
    y = kt.decode_layer(a)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, kt.decode_layer(b))
    batch = kt.encode_batch(np.stack([x64, 2 * x64]), p)
    assert [e.to_bytes() for e in batch] == [
        e.to_bytes() for e in kt.encode_batch(np.stack([X, 2 * X]), p)
    ]
    t = kt.encode_layer(torch.from_numpy(x64), p)
    assert t.to_bytes() == b.to_bytes()
    assert kt.decode_layer(t).dtype == torch.float32
    assert kt.stage_errors(x64, p) == kt.stage_errors(X, p)
    w = np.linspace(0.5, 1.5, len(X))
    assert (
        kt.encode_layer(x64, p, weights=w).to_bytes()
        == kt.encode_layer(X, p, weights=w.astype(np.float32)).to_bytes()
    )


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_input(value):
    x = X.copy()
    x[7, 3] = value
    with pytest.raises(ValueError, match="non-finite value .* at token 7, dim 3"):
        kt.encode_layer(x)
    with pytest.raises(ValueError, match="non-finite"):
        kt.encode_batch(x[None])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bit_width": 5}, "bit_width"),
        ({"bit_width": -1}, "bit_width"),
        ({"block_size": 0}, "block_size"),
        ({"variance_ratio": 0.0}, "variance_ratio"),
        ({"variance_ratio": 1.01}, "variance_ratio"),
        ({"k": 600}, "k"),
        ({"outlier_threshold": 0.0}, "outlier_threshold"),
        ({"pca_method": "svd"}, "pca_method"),
        ({"metric": "cosine"}, "metric"),
        ({"skeleton_dtype": "int8"}, "skeleton_dtype"),
        ({"target_rank": 8}, "target_rank"),
        ({"bit_width": 2, "centroids": [0.0, 1.0]}, "centroids"),
        ({"bit_width": 1, "centroids": [1.0, 0.0]}, "ascending"),
        ({"rank_cap": -3}, "rank_cap"),
    ],
)
def test_invalid_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kt.CodecParams(**kwargs)


def test_unknown_param_and_positional():
    with pytest.raises(TypeError, match="'bits'"):
        kt.CodecParams(bits=3)
    with pytest.raises(TypeError):
        kt.CodecParams(3)
    with pytest.raises(TypeError, match='unexpected keyword argument "bits"'):
        kt.CodecParams().replace(bits=3)


INT_FIELDS = "block_size bit_width target_rank oversample power_iters rank_cap k kmeans_iters seed"
FLOAT_FIELDS = "variance_ratio outlier_threshold bits_per_value"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seed": -1}, r"seed must be in 0\.\.=18446744073709551615, got -1"),
        ({"seed": 2**64}, r"seed must be in 0\.\.=18446744073709551615, got 18446744073709551616"),
        ({"k": 2**64}, r"k must be in 0\.\.=4096, got 18446744073709551616"),
        ({"k": -(2**70)}, r"k must be in 0\.\.=4096, got -1180591620717411303424"),
        ({"block_size": 2**100}, r"block_size must be in 1\.\.=65536"),
        ({"bit_width": 256}, r"bit_width must be in 1\.\.=8, got 256"),
        ({"target_rank": -1}, r"target_rank must be in 0\.\.=4096, got -1"),
        ({"kmeans_iters": 2**40}, r"kmeans_iters must be in 0\.\.=65536"),
    ],
)
def test_out_of_range_ints_are_value_errors_naming_field_and_range(kwargs, match):
    """Beyond what the field's type holds is no OverflowError: a ValueError with the range."""
    with pytest.raises(ValueError, match=match) as e:
        kt.CodecParams(**kwargs)
    assert not isinstance(e.value, OverflowError)
    with pytest.raises(ValueError, match=match):
        kt.CodecParams().replace(**kwargs)


@pytest.mark.parametrize("name", INT_FIELDS.split())
def test_bools_are_not_ints(name):
    with pytest.raises(TypeError, match=f"{name} must be an int, not bool"):
        kt.CodecParams(**{name: True})
    with pytest.raises(TypeError, match=f"{name} must be an int, got float"):
        kt.CodecParams(**{name: 1.0})


@pytest.mark.parametrize("name", FLOAT_FIELDS.split())
def test_bools_are_not_floats(name):
    with pytest.raises(TypeError, match=f"{name} must be a float, not bool"):
        kt.CodecParams(**{name: True})
    with pytest.raises(TypeError, match=f"{name} must be a float, got str"):
        kt.CodecParams(**{name: "1"})


def test_int_like_values_are_still_accepted():
    p = kt.CodecParams(seed=np.uint64(2**64 - 1), k=np.int32(4), bits_per_value=1, block_size=64)
    assert (p.seed, p.k, p.bits_per_value, p.block_size) == (2**64 - 1, 4, 1.0, 64)


def test_batch_non_finite_names_the_stream_and_position():
    x = np.random.default_rng(4).standard_normal((3, 40, 16)).astype(np.float32)
    x[2, 7, 3] = np.nan
    with pytest.raises(ValueError, match=r"stream 2: .*non-finite.* at token 7, dim 3"):
        kt.encode_batch(x)
    x[2, 7, 3] = 1e9
    with pytest.raises(ValueError, match=r"stream 2: .* at token 7, dim 3 exceeds"):
        kt.encode_batch(x)


def test_too_large_magnitude_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the supported range"):
        kt.encode_layer(X * 1e6)


@pytest.fixture(scope="module")
def blob() -> bytes:
    p = kt.CodecParams(bit_width=3, block_size=128, k=4)
    return kt.encode_layer(X, p).to_bytes()


def test_every_truncation_raises_format_error(blob):
    for cut in range(len(blob)):
        with pytest.raises(kt.FormatError):
            kt.EncodedLayer.from_bytes(blob[:cut])


def test_bit_flips_raise_format_error(blob):
    rng = np.random.default_rng(1)
    for _ in range(3000):
        b = bytearray(blob)
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        with pytest.raises(kt.FormatError):
            kt.EncodedLayer.from_bytes(bytes(b))


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_valid_checksum_does_not_make_hostile_fields_pass(blob):
    """An attacker can recompute the CRC: every field is still validated."""
    rng = np.random.default_rng(2)
    body = blob[:-4]
    for _ in range(3000):
        b = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(b)))
            b[i] = int(rng.integers(256))
        data = _with_crc(bytes(b))
        try:
            enc = kt.EncodedLayer.from_bytes(data)
        except kt.FormatError:
            continue
        # Some edits hit code bits and stay valid: then decoding must work and be finite.
        y = kt.decode_layer(enc)
        assert np.isfinite(y).all() and y.shape == X.shape


def test_hostile_sizes_are_rejected_before_allocation(blob):
    b = bytearray(blob[:-4])
    b[8:12] = struct.pack("<I", 2**31)  # n_tokens
    b[16:20] = struct.pack("<I", 2**31 // 128)  # n_blocks consistent with it
    with pytest.raises(kt.FormatError, match="[Tt]runcated|decode limit"):
        kt.EncodedLayer.from_bytes(_with_crc(bytes(b)))


def test_random_garbage_and_wrong_types():
    rng = np.random.default_rng(3)
    for n in range(0, 400, 3):
        with pytest.raises(kt.FormatError):
            kt.EncodedLayer.from_bytes(rng.bytes(n))
    with pytest.raises(kt.FormatError, match="magic"):
        kt.EncodedLayer.from_bytes(b"NOPE" + bytes(100))
    with pytest.raises(TypeError, match="data"):
        kt.EncodedLayer.from_bytes("not bytes")


def test_checksum_and_version_errors_carry_their_fields(blob):
    b = bytearray(blob)
    b[-1] ^= 0xFF
    with pytest.raises(kt.ChecksumError) as e:
        kt.EncodedLayer.from_bytes(bytes(b))
    stored = struct.unpack("<I", bytes(b[-4:]))[0]
    assert e.value.stored == stored
    assert e.value.computed == zlib.crc32(bytes(b[:-4])) != stored
    assert f"{stored:#010x}" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is kt.ChecksumError and again.stored == stored

    b = bytearray(blob)
    b[4:6] = struct.pack("<H", 2)
    with pytest.raises(kt.UnsupportedVersionError, match="version 2") as e:
        kt.EncodedLayer.from_bytes(bytes(b))
    assert e.value.version == 2
    assert e.value.supported == (kt.FORMAT_VERSION,)
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.version, again.supported) == (2, (kt.FORMAT_VERSION,))


def test_every_project_exception_derives_from_the_base():
    from kakeyaturbo.calibration import CalibrationError
    from kakeyaturbo.vllm.engine import EagerModeError

    for exc in (kt.FormatError, kt.ChecksumError, kt.UnsupportedVersionError):
        assert issubclass(exc, kt.KakeyaTurboError)
    assert issubclass(kt.UnsupportedVersionError, kt.FormatError)
    assert issubclass(kt.ChecksumError, kt.FormatError)
    # The Python-side errors keep their builtin bases, so existing handlers still work.
    assert issubclass(CalibrationError, kt.KakeyaTurboError)
    assert issubclass(CalibrationError, ValueError)
    assert issubclass(EagerModeError, kt.KakeyaTurboError)
    assert issubclass(EagerModeError, RuntimeError)


def test_decode_batch_caps_the_total_decoded_size():
    """Each layer may decode to DECODE_FLOOR (64 MiB) whatever its size; a batch of many
    small layers, each valid on its own, may not add up to more than one layer could."""
    p = kt.CodecParams(
        allocation="waterfill", k=0, pca_method="none", block_size=8192, bits_per_value=0.25
    )
    # Constant rows: every component has zero variance, so no code bits at all.
    enc = kt.encode_layer(np.zeros((8192, 64), np.float32), p)
    assert enc.nbytes < 1000  # 2 MiB of output from a few hundred bytes
    one = kt.EncodedLayer.from_bytes(enc.to_bytes())
    assert kt.decode_batch([one, one]).shape == (2, 8192, 64)
    with pytest.raises(kt.FormatError, match=r"encs: .*64 layers would decode to .* decode limit"):
        kt.decode_batch([one] * 64)
