"""Bad input gets a clear Python exception naming the problem; hostile bytes always raise
FormatError (never a crash, a hang or a huge allocation)."""

from __future__ import annotations

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
        (X.astype(np.float64), TypeError, "x: dtype float64"),
        (X.astype(np.int32), TypeError, "x: dtype int32"),
        (torch.from_numpy(X).double(), TypeError, "x: dtype torch.float64"),
        ([[1.0, 2.0]], TypeError, "x: expected a numpy array"),
        (X[0], ValueError, "x: expected 2 dimensions"),
        (X[None], ValueError, "x: expected 2 dimensions"),
        (X[:0], ValueError, "x: empty"),
    ],
)
def test_bad_arrays(bad, exc, match):
    with pytest.raises(exc, match=match):
        kt.encode_layer(bad)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_input(value):
    x = X.copy()
    x[7, 3] = value
    with pytest.raises(ValueError, match="non-finite"):
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
    with pytest.raises(TypeError):
        kt.CodecParams(bits=3)
    with pytest.raises(TypeError):
        kt.CodecParams(3)
    with pytest.raises(ValueError, match="no field"):
        kt.CodecParams().replace(bits=3)


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


def test_checksum_and_version_errors(blob):
    b = bytearray(blob)
    b[-1] ^= 0xFF
    with pytest.raises(kt.ChecksumError):
        kt.EncodedLayer.from_bytes(bytes(b))
    b = bytearray(blob)
    b[4:6] = struct.pack("<H", 2)
    with pytest.raises(kt.UnsupportedVersionError, match="version 2"):
        kt.EncodedLayer.from_bytes(bytes(b))
    assert issubclass(kt.UnsupportedVersionError, kt.FormatError)
    assert issubclass(kt.ChecksumError, kt.FormatError)
    assert issubclass(kt.FormatError, kt.KakeyaTurboError)
