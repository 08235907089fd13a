"""Every blob the reader accepts decodes to finite values of its declared shape: mutations of
honest encodings (bytes flipped, set or cut, with the checksum recomputed so that they reach
the parser) either raise FormatError or decode finite, in float32 and float16 alike."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kakeyaturbo as kt

_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((96, 16)).astype(np.float32) * 50
HONEST = [
    kt.encode_layer(_X, kt.CodecParams(block_size=32)).to_bytes(),
    kt.encode_layer(_X.astype(np.float16), kt.CodecParams(block_size=64, bit_width=2)).to_bytes(),
    kt.encode_layer(
        _X, kt.CodecParams(block_size=48, allocation="waterfill", k=0, pca_method="none")
    ).to_bytes(),
    kt.encode_layer(_X, kt.CodecParams(block_size=32, k=4, outlier_threshold=2.0)).to_bytes(),
]


def _sealed(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@st.composite
def mutated(draw):
    blob = bytearray(draw(st.sampled_from(HONEST))[:-4])
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(blob) - 1))
        if draw(st.booleans()):
            blob[i] ^= 1 << draw(st.integers(0, 7))
        else:
            blob[i] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x7B, 0x7C]))
    if draw(st.integers(0, 9)) == 0:
        del blob[draw(st.integers(0, len(blob) - 1)) :]
    return _sealed(bytes(blob))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_every_accepted_blob_decodes_finite(blob):
    try:
        enc = kt.EncodedLayer.from_bytes(blob)
    except kt.FormatError:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an overflow warning is garbage too
            y = np.asarray(kt.decode_layer(enc))
    except kt.FormatError:
        return
    assert y.shape == tuple(enc.shape)
    assert np.isfinite(y).all()


def test_the_mutations_reach_the_decoder():
    """Not everything is refused at the header: some mutated blobs decode (the property above
    would pass vacuously if the checksum or the header caught every mutation)."""
    rng = np.random.default_rng(1)
    decoded = 0
    for n in range(300):
        blob = bytearray(HONEST[n % len(HONEST)][:-4])
        blob[int(rng.integers(100, len(blob)))] ^= 1 << int(rng.integers(0, 8))
        try:
            kt.decode_layer(kt.EncodedLayer.from_bytes(_sealed(bytes(blob))))
            decoded += 1
        except kt.FormatError:
            pass
    assert decoded > 30, decoded
