"""NaN or infinity given to an attention entry point is a ValueError naming the argument and
the index, not a silently masked token or a zero row (the kernels' softmax skips NaN); a bias
may hold -inf (a mask). int8 rows refuse non-finite values."""

from __future__ import annotations

import numpy as np
import pytest

import kakeyaturbo as kt
from kakeyaturbo import _core
from kakeyaturbo.codec import coded_attend, coded_key_logits, coded_value_sums, prepare_keys

S, D, T, E = 2, 16, 64, 3  # streams, head_dim, coded tokens per stream, exact tokens


def _encs():
    x = np.random.default_rng(0).standard_normal((S, T, D), dtype=np.float32)
    return [kt.encode_layer(x[s], kt.CodecParams(block_size=T)) for s in range(S)]


def _inputs():
    rng = np.random.default_rng(1)
    return dict(
        queries=rng.standard_normal((S, 1, D), dtype=np.float32),
        exact_keys=rng.standard_normal((S, E, D), dtype=np.float32),
        exact_values=rng.standard_normal((S, E, D), dtype=np.float32),
        scaling=0.25,
        key_norms=np.ones((S, T), np.float32),
        value_norms=np.ones((S, T), np.float32),
        key_frames=np.eye(D, dtype=np.float32)[None],
        value_frames=np.eye(D, dtype=np.float32)[None],
        bias=np.zeros((1, 1, T + E), np.float32),
    )


def _attend(encs, **args):
    return coded_attend(
        encs,
        encs,
        S,
        args.pop("queries"),
        args.pop("exact_keys"),
        args.pop("exact_values"),
        args.pop("scaling"),
        **args,
    )


@pytest.mark.parametrize(
    "name, index",
    [
        ("queries", (1, 0, 3)),
        ("exact_keys", (0, 2, 5)),
        ("exact_values", (1, 1, 0)),
        ("key_norms", (0, 7)),
        ("value_norms", (1, 63)),
        ("key_frames", (0, 2, 2)),
        ("value_frames", (0, 0, 1)),
        ("bias", (0, 0, 10)),
    ],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_array_is_named_with_its_index(name, index, bad):
    encs, args = _encs(), _inputs()
    assert np.isfinite(_attend(encs, **_inputs())).all()
    args[name][index] = bad
    where = ", ".join(map(str, index))
    with pytest.raises(
        ValueError, match=rf"^{name}\[{where}\] is {'nan' if bad != bad else 'inf'}"
    ):
        _attend(encs, **args)


def test_a_minus_inf_bias_is_a_mask_not_an_error():
    encs, args = _encs(), _inputs()
    args["bias"][0, 0, :T] = -np.inf  # every coded token masked: the exact ones remain
    out = _attend(encs, **args)
    exact = _inputs()
    logits = np.einsum("srd,sed->sre", exact["queries"], exact["exact_keys"]) * 0.25
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("sre,sed->srd", w / w.sum(-1, keepdims=True), exact["exact_values"])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, value", [("scaling", np.nan), ("softcap", np.inf)])
def test_non_finite_scalars_are_named(name, value):
    encs, args = _encs(), _inputs()
    args[name] = value
    with pytest.raises(ValueError, match=rf"^{name} is (nan|inf): must be finite"):
        _attend(encs, **args)


def test_exact_runs_in_a_list_name_the_run():
    encs, args = _encs(), _inputs()
    keys = args["exact_keys"]
    args["exact_keys"] = [keys[:, :1].copy(), keys[:, 1:].copy()]
    args["exact_keys"][1][0, 1, 4] = np.nan
    with pytest.raises(ValueError, match=r"^exact_keys\[1\]\[0, 1, 4\] is nan"):
        _attend(encs, **args)


def test_bfloat16_bits_and_int8_rows_are_checked():
    encs, args = _encs(), _inputs()
    bits = np.zeros((S, E, D), np.uint16)
    bits[1, 0, 2] = 0x7FC0  # bfloat16 NaN
    args["exact_keys"] = bits
    with pytest.raises(ValueError, match=r"^exact_keys\[1, 0, 2\] is nan: bfloat16 values"):
        _attend(encs, **args)
    args = _inputs()
    rows = _core.int8_rows_encode(args["exact_values"])
    np.testing.assert_array_equal(rows[..., -2:].shape, (S, E, 2))
    rows[0, 2, -2:] = np.array([0x7F, 0x7F], np.uint8).view(np.int8)  # scale bytes 0x7F7F
    args["exact_values"] = rows
    with pytest.raises(ValueError, match=r"^exact_values scales\[0, 2\] is 3.3\d*e\+38"):
        _attend(encs, **args)
    rows[0, 2, -2:] = np.array([0x80, 0x7F], np.uint8).view(np.int8)  # bfloat16 +inf
    with pytest.raises(ValueError, match=r"^exact_values scales\[0, 2\] is inf"):
        _attend(encs, **args)


def test_the_other_entry_points_name_their_arrays():
    encs = _encs()
    q = _inputs()["queries"]
    q[0, 0, 1] = np.nan
    with pytest.raises(ValueError, match=r"^queries\[0, 0, 1\] is nan"):
        coded_key_logits(encs, S, q)
    w = np.ones((S, 1, T), np.float32)
    w[1, 0, 5] = np.inf
    with pytest.raises(ValueError, match=r"^weights\[1, 0, 5\] is inf"):
        coded_value_sums(encs, S, w)
    frames = np.eye(D, dtype=np.float32)[None].copy()
    frames[0, 3, 3] = np.nan
    with pytest.raises(ValueError, match=r"^key_frames\[0, 3, 3\] is nan"):
        prepare_keys(encs, S, key_frames=frames, background=False)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_rows_refuse_non_finite_rows(bad):
    x = np.ones((3, 4, 8), np.float32)
    x[1, 2, 5] = bad
    with pytest.raises(ValueError, match=r"^x: row 6 holds (NaN|inf|-inf) at column 5"):
        _core.int8_rows_encode(x)


def test_rotation_is_checked_where_it_is_read():
    encs = _encs()
    rotation = np.zeros((1, T, 2, D // 2), np.float32)
    rotation[:, :, 0] = 1.0  # cosines 1, sines 0: no turn
    q = _inputs()["queries"]
    coded_key_logits(encs, S, q, rotation=rotation)
    rotation[0, 9, 1, 2] = np.inf
    with pytest.raises(ValueError, match=r"^rotation\[0, 9, 1, 2\] is inf: must be finite"):
        coded_key_logits(encs, S, q, rotation=rotation)
    with pytest.raises(ValueError, match=r"^rotation\[0, 9, 1, 2\] is inf"):
        prepare_keys(encs, S, rotation=rotation, background=False)


@pytest.mark.parametrize("name", ["exact_queries", "key_scales", "value_scales"])
def test_streams_across_heads_check_their_own_inputs(name):
    heads, dh, rows = 2, D // 2, 2
    rng = np.random.default_rng(2)
    args = dict(
        exact_queries=rng.standard_normal((S, rows, dh), dtype=np.float32),
        key_scales=np.ones((S, heads, T), np.float32),
        value_scales=np.ones((S, heads, T), np.float32),
    )
    ex = rng.standard_normal((S * heads, E, dh), dtype=np.float32)

    def call():
        return coded_attend(
            _encs(),
            _encs(),
            S,
            rng.standard_normal((S, rows, D), dtype=np.float32),
            ex,
            ex,
            0.25,
            value_frames=np.eye(D, dh, dtype=np.float32)[None].repeat(heads, 0),
            heads=heads,
            **args,
        )

    assert np.isfinite(call()).all()
    args[name][1, 1, 3] = np.nan
    with pytest.raises(ValueError, match=rf"^{name}\[1, 1, 3\] is nan: must be finite"):
        call()
