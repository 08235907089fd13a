"""One cap on what a call may decode or prepare, the rule of `decode_batch`, on every entry
point: many small honest blobs (zeros, one 65536-token block each, 16 MiB declared from a few
hundred stored bytes) must not add up to an allocation no single blob could make."""

from __future__ import annotations

import numpy as np
import pytest

import kakeyaturbo as kt
from kakeyaturbo.codec import (
    coded_attend,
    coded_key_logits,
    coded_value_sums,
    core_layers,
    prepare_keys,
)
from kakeyaturbo.decode_limit import DECODE_FLOOR, ENV, check_decode_limit, set_decode_limit

D, T = 64, 65536


@pytest.fixture(scope="module")
def blob():
    # water-filling gives zeros no bits: a header, a block header and a checksum
    params = kt.CodecParams(block_size=T, allocation="waterfill", k=0, pca_method="none")
    enc = kt.encode_layer(np.zeros((T, D), np.float32), params)
    assert enc.nbytes < 1024 and T * D * 4 == 16 << 20  # 16 MiB from under 1 KiB
    return enc


def _calls(encs):
    s = len(encs)
    q = np.zeros((s, 1, D), np.float32)
    none = np.zeros((s, 0, D), np.float32)
    return {
        "prepare_keys": lambda: prepare_keys(encs, s, background=False),
        "coded_key_logits": lambda: coded_key_logits(encs, s, q),
        "coded_value_sums": lambda: coded_value_sums(encs, s, np.zeros((s, 1, T), np.float32)),
        "coded_attend": lambda: coded_attend(
            encs[: s // 2],
            encs[s // 2 :],
            s // 2,
            q[: s // 2],
            none[: s // 2],
            none[: s // 2],
            0.125,
        ),
        "decode_batch": lambda: kt.decode_batch(encs),
    }


@pytest.mark.parametrize("entry", list(_calls([None, None])))
def test_48_small_blobs_are_refused_before_anything_is_allocated(blob, entry):
    with pytest.raises(kt.FormatError, match=r"layers would decode to \d+ bytes .* decode limit"):
        _calls([blob] * 48)[entry]()


@pytest.mark.parametrize("entry", ["prepare_keys", "coded_key_logits", "coded_attend"])
def test_honest_calls_below_the_cap_run(blob, entry):
    encs = [blob] * 2  # 32 MiB declared: within the 64 MiB floor
    assert 2 * T * D * 4 <= DECODE_FLOOR
    _calls(encs)[entry]()


def test_core_layers_count_their_bytes_once(blob):
    layers = core_layers([blob] * 48)
    assert layers.totals == (48 * T * D * 4, 48 * blob.nbytes)
    with pytest.raises(kt.FormatError, match="key_encs: 48 layers"):
        prepare_keys(layers, 48, background=False)


def test_the_environment_lowers_the_cap(blob, monkeypatch):
    small = [kt.encode_layer(np.ones((64, 16), np.float32))] * 2
    check_decode_limit("x", small)
    monkeypatch.setenv(ENV, "4096")  # 2 x 64 x 16 x 4 = 8192 bytes declared
    with pytest.raises(kt.FormatError, match=rf"x: 2 layers .* \(4096 bytes; {ENV} or set_decode"):
        check_decode_limit("x", small)
    with pytest.raises(kt.FormatError, match="decode limit"):
        kt.decode_batch(small)
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"{ENV}='lots': expected a whole number"):
        check_decode_limit("x", small)


def test_set_decode_limit_lowers_the_cap_until_removed(blob):
    small = [kt.encode_layer(np.ones((64, 16), np.float32))] * 2
    try:
        set_decode_limit(8191)  # one byte short of the 8192 declared
        with pytest.raises(kt.FormatError, match=r"\(8191 bytes;"):
            prepare_keys(small, 2, background=False)
        kt.decode_layer(small[0])  # 4096 bytes alone
        set_decode_limit(4095)
        with pytest.raises(kt.FormatError, match=r"^enc: 1 layers would decode to 4096 bytes"):
            kt.decode_layer(small[0])
        set_decode_limit(8192)
        prepare_keys(small, 2, background=False)
    finally:
        set_decode_limit(None)
    check_decode_limit("x", [blob] * 4)  # 64 MiB: the floor again
    with pytest.raises(ValueError, match="must be >= 0"):
        set_decode_limit(-1)
    with pytest.raises(TypeError, match="expected an int or None"):
        set_decode_limit(1.5)
