"""Decoding to float16 saturates at its range instead of overflowing to inf, for honest input
near the limit and for a blob with hostile (valid, checksummed) scales; and the API's checks of
layers, counts and arrays name the argument and what was expected."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo import _core
from kakeyaturbo.codec import (
    coded_attend,
    coded_key_logits,
    coded_value_sums,
    core_layers,
    decode_norm_codes,
    prepare_keys,
)

F16_MAX = 65504.0
NEAR_LIMIT = np.random.default_rng(0).uniform(-60000, 60000, (64, 16)).astype(np.float16)
WATERFILL = kt.CodecParams(block_size=64, allocation="waterfill", k=0, pca_method="none")
D, T = 16, 64


def _finite_f16(y, shape=NEAR_LIMIT.shape) -> np.ndarray:
    y = y.numpy() if isinstance(y, torch.Tensor) else y
    assert y.dtype == np.float16 and y.shape == shape
    assert np.isfinite(y).all() and np.abs(y).max() <= F16_MAX
    return y


def test_honest_float16_near_its_limit_saturates_without_warning():
    enc = kt.encode_layer(NEAR_LIMIT, kt.CodecParams(block_size=64))
    raw = _core.decode_layer(enc._raw)  # the codec's float32 reconstruction
    assert np.abs(raw).max() > F16_MAX  # past float16's range: the case saturation is for
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = _finite_f16(kt.decode_layer(enc))
        batch = kt.decode_batch([enc, enc])
        t = kt.decode_layer(kt.encode_layer(torch.from_numpy(NEAR_LIMIT), enc.params))
    np.testing.assert_array_equal(y, np.clip(raw, -F16_MAX, F16_MAX).astype(np.float16))
    # Saturating moves values towards the input's range: the error is at most the codec's,
    # plus float16's rounding (half its step of 32 above 32768).
    x = NEAR_LIMIT.astype(np.float32)
    assert np.abs(y.astype(np.float32) - x).max() <= np.abs(raw - x).max() + 16
    np.testing.assert_array_equal(_finite_f16(batch, (2, 64, 16)), np.stack([y, y]))
    assert t.dtype == torch.float16
    np.testing.assert_array_equal(_finite_f16(t), y)


def hostile_blob() -> bytes:
    """A float16 layer whose every component scale is float16's largest, CRC recomputed."""
    body = bytearray(kt.encode_layer(NEAR_LIMIT, WATERFILL).to_bytes()[:-4])
    sigma = 80 + 20 + 2 * D  # header, block header, fp16 mean [D]; then sigma f16 x d_eff (= D)
    assert body[sigma : sigma + 2 * D] != b"\xff\x7b" * D
    body[sigma : sigma + 2 * D] = b"\xff\x7b" * D
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def test_hostile_float16_scales_decode_finite():
    enc = kt.EncodedLayer.from_bytes(hostile_blob())
    assert enc.dtype == "float16"
    assert np.isinf(_core.decode_layer(enc._raw).astype(np.float32)).sum() == 0
    assert (np.abs(_core.decode_layer(enc._raw)) > F16_MAX).sum() > 100  # would be inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = _finite_f16(kt.decode_layer(enc))
        np.testing.assert_array_equal(_finite_f16(kt.decode_layer(enc, out="torch")), y)
        np.testing.assert_array_equal(_finite_f16(kt.decode_block(enc)), y)
        np.testing.assert_array_equal(_finite_f16(kt.decode_batch([enc]), (1, 64, 16))[0], y)


def _layers(n: int = 4) -> list:
    rng = np.random.default_rng(1)
    return [kt.encode_layer(rng.standard_normal((T, D), dtype=np.float32)) for _ in range(n)]


def _queries(streams: int = 2) -> np.ndarray:
    return np.random.default_rng(2).standard_normal((streams, 1, D), dtype=np.float32)


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` one byte off its dtype's alignment."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    m = np.frombuffer(buf.data, a.dtype, a.size, offset=1).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned and m.flags.c_contiguous
    return m


def test_core_layer_instances_are_named_for_what_they_are():
    raw = _layers(1)[0]._raw
    want = (
        r"expected kakeyaturbo\.EncodedLayer, got kakeyaturbo\._core\.EncodedLayer "
        r"\(the core's own object: wrap it as kakeyaturbo\.EncodedLayer\(raw\)\)"
    )
    for call, name in [
        (lambda: kt.decode_layer(raw), "enc"),
        (lambda: kt.decode_block(raw), "enc"),
        (lambda: kt.decode_batch([raw]), r"encs\[0\]"),
        (lambda: coded_key_logits([raw], 1, _queries(1)), r"encs\[0\]"),
        (lambda: core_layers([raw]), r"encs\[0\]"),
    ]:
        with pytest.raises(TypeError, match=f"^{name}: {want}$"):
            call()
    encs = _layers(2)
    with pytest.raises(TypeError, match=r"^value_encs\[1\]: expected kakeyaturbo\.EncodedLayer"):
        coded_attend(encs, [encs[0], raw], 2, _queries(), _queries(), _queries(), 0.25)
    wrapped = kt.decode_layer(kt.EncodedLayer(raw))
    np.testing.assert_array_equal(wrapped, kt.decode_layer(encs[0]))


def test_iterators_of_layers_are_read_once():
    encs, q = _layers(), _queries()
    want = coded_key_logits(encs, 2, q)
    np.testing.assert_array_equal(coded_key_logits(iter(encs), 2, q), want)
    np.testing.assert_array_equal(coded_key_logits((e for e in encs), 2, q), want)
    w = np.ones((2, 1, 2 * T), np.float32)
    got = coded_value_sums((e for e in encs), 2, w)
    np.testing.assert_array_equal(got, coded_value_sums(encs, 2, w))
    np.testing.assert_array_equal(kt.decode_batch(e for e in encs), kt.decode_batch(encs))
    assert len(core_layers(e for e in encs)) == 4
    assert prepare_keys((e for e in encs), 2, background=False) is not None


def test_what_is_not_a_sequence_of_layers_is_named():
    enc = _layers(1)[0]
    with pytest.raises(TypeError, match=r"^encs: expected a sequence of EncodedLayer, got int$"):
        kt.decode_batch(5)
    with pytest.raises(TypeError, match=r"^encs: expected a sequence .*got one \(pass \[layer\]\)"):
        kt.decode_batch(enc)
    with pytest.raises(TypeError, match=r"^key_encs: expected a sequence of EncodedLayer"):
        prepare_keys(enc, 1, background=False)


def test_misaligned_arrays_are_copied_and_strided_ones_refused_by_name():
    encs, q = _layers(), _queries()
    want = coded_key_logits(encs, 2, q)
    np.testing.assert_array_equal(coded_key_logits(encs, 2, _misaligned(q)), want)
    w = np.ones((2, 1, 2 * T), np.float32)
    np.testing.assert_array_equal(
        coded_value_sums(encs, 2, _misaligned(w)), coded_value_sums(encs, 2, w)
    )
    ex = np.ones((2, 3, D), np.float32)
    want = coded_attend(encs, encs, 2, q, ex, [ex], 0.25)
    got = coded_attend(encs, encs, 2, _misaligned(q), [_misaligned(ex)], _misaligned(ex), 0.25)
    np.testing.assert_array_equal(got, want)
    codes, bounds = [np.zeros((2, T), np.uint8)], [np.ones((2, 2), np.float16)]
    want = decode_norm_codes((codes, bounds), 2)
    got = decode_norm_codes((codes, [_misaligned(bounds[0])]), 2)
    np.testing.assert_array_equal(got, want)
    x, weights = np.ones((T, D), np.float32), np.linspace(0, 1, T, dtype=np.float32)
    enc = kt.encode_layer(_misaligned(x), weights=_misaligned(weights))
    assert enc == kt.encode_layer(x, weights=weights)
    # Not C-contiguous: the core reads these in place, and says which it cannot.
    strided = np.repeat(q, 2, axis=2)[:, :, ::2]
    with pytest.raises(TypeError, match=r"^queries: expected a C-contiguous float32 array"):
        coded_key_logits(encs, 2, strided)
    with pytest.raises(TypeError, match=r"^norms: expected \(codes, bounds\)"):
        decode_norm_codes((codes, [np.ones((2, 4), np.float16)[:, ::2]]), 2)


def test_a_prepared_rotation_must_be_the_callers_own_readable_array():
    encs = _layers()
    rotation = np.zeros((1, 2 * T, 2, D // 2), np.float32)
    rotation[:, :, 0] = 1.0  # cos 1, sin 0: no turn
    want = r"^rotation: the array is misaligned in memory; prepared keys read it in place, so"
    with pytest.raises(TypeError, match=want):
        prepare_keys(encs, 2, rotation=_misaligned(rotation), background=False)
    prepared = prepare_keys(encs, 2, rotation=rotation, background=False)
    q, ex = _queries(), np.ones((2, 3, D), np.float32)
    with pytest.raises(TypeError, match=want):
        coded_attend(
            encs, encs, 2, q, ex, ex, 0.25, rotation=_misaligned(rotation), prepared=prepared
        )
    got = coded_attend(
        encs, encs, 2, _misaligned(q), ex, ex, 0.25, rotation=rotation, prepared=prepared
    )
    np.testing.assert_array_equal(
        got, coded_attend(encs, encs, 2, q, ex, ex, 0.25, rotation=rotation)
    )


@pytest.mark.parametrize("flag", [True, np.True_])
def test_bools_are_not_counts(flag):
    encs, q, ex = _layers(), _queries(1), np.ones((1, 3, D), np.float32)
    calls = [
        ("streams", lambda: coded_key_logits(encs, flag, q)),
        ("rotation_repeats", lambda: coded_key_logits(encs, 1, q, rotation_repeats=flag)),
        ("streams", lambda: coded_value_sums(encs, flag, np.ones((1, 1, 4 * T), np.float32))),
        ("streams", lambda: coded_attend(encs, encs, flag, q, ex, ex, 0.25)),
        ("heads", lambda: coded_attend(encs, encs, 1, q, ex, ex, 0.25, heads=flag)),
        ("streams", lambda: prepare_keys(encs, flag, background=False)),
        ("streams", lambda: decode_norm_codes(([], []), flag)),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=f"^{name}: expected an int, got bool True$"):
            call()
