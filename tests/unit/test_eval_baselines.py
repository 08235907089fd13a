"""Peer codecs: bytes against hand counts, error bounds, and that batch rows never mix."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kakeyaturbo.eval.baselines import lloyd_max_sphere, minmax_quantize
from kakeyaturbo.eval.registry import build_method

B, H, T, D = 2, 2, 100, 64  # T is not a multiple of KIVI's group on purpose


def _x(seed=0, shape=(B, H, T, D)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _total(rows):
    assert len(rows) == B
    assert all(r == rows[0] for r in rows)
    return sum(rows[0].values())


# bytes of one passage's [H, T, D] stream, counted by hand from each format's definition
HAND_COUNTS = {
    "identity": ("k", H * T * D * 4),
    "bf16": ("k", H * T * D * 2),
    "fp8": ("k", H * T * D + 4 * H),  # one byte per element, fp32 scale per head
    "fp8:granularity=tensor": ("k", H * T * D + 4),
    # keys: 2-bit codes + (scale, zero) fp16 per channel per 32-token group (4 groups for 100)
    "kivi:bits=2": ("k", H * T * D * 2 // 8 + H * D * 4 * 4),
    # values: per token, 2 groups of 32 channels
    "kivi:bits=2,group=32": ("v", H * T * D * 2 // 8 + H * T * 2 * 4),
    "kivi:bits=3,k_group=50": ("k", H * T * D * 3 // 8 + H * D * 2 * 4),
    # 3 bits per coordinate + an fp16 norm per vector
    "turboquant:bits=3": ("k", H * T * D * 3 // 8 + H * T * 2),
    # 2 + 1 (QJL) bits per coordinate + two fp16 norms per vector
    "turboquant:bits=3,qjl=1": ("v", H * T * D * 3 // 8 + H * T * 4),
    "zero": ("v", 0),
}


@pytest.mark.parametrize("spec", sorted(HAND_COUNTS))
def test_bytes_match_hand_count(spec):
    stream, expected = HAND_COUNTS[spec]
    x = _x()
    x_hat, rows = build_method(spec).compress(x, 0, stream)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert _total(rows) == expected


@pytest.mark.parametrize(
    "spec",
    ["bf16", "fp8", "kivi:bits=2", "kivi:bits=4", "turboquant:bits=2", "turboquant:bits=3,qjl=1"],
)
@pytest.mark.parametrize("stream", ["k", "v"])
def test_rows_are_independent(spec, stream):
    # each batch row is a passage: its reconstruction must not depend on the other rows
    x = _x(1)
    m = build_method(spec)
    both, _ = m.compress(x, 0, stream)
    one, _ = m.compress(x[1:].clone() * 1.0, 0, stream)
    assert torch.equal(both[1:], one)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(1, 8),
    group=st.integers(1, 40),
    n=st.integers(1, 70),
    scale=st.floats(0.01, 50.0),
    seed=st.integers(0, 2**16),
)
def test_minmax_error_is_at_most_half_a_step(bits, group, n, scale, seed):
    x = _x(seed, (1, 2, n, 8)) * scale
    x_hat, groups = minmax_quantize(x, bits, group, dim=2)
    assert groups == 2 * 8 * math.ceil(n / group)
    # per group: step = (max - min) / (2^bits - 1); fp16 rounding of scale and zero adds a little
    xs = x.reshape(1, 2, n, 8)
    for g0 in range(0, n, group):
        sl = xs[:, :, g0 : g0 + group]
        step = (sl.amax(2) - sl.amin(2)) / (2**bits - 1)
        err = (x_hat[:, :, g0 : g0 + group] - sl).abs().amax(2)
        bound = step / 2 + 2e-3 * sl.abs().amax(2) + 1e-6
        assert bool((err <= bound * 1.01).all())


def test_kivi_groups_keys_per_channel_and_values_per_token():
    # a key channel that is constant along tokens is exact; so is a value token constant
    # along channels - each falls in groups of its own kind
    x = _x(2, (1, 1, 64, 64))
    k = x.clone()
    k[..., 5] = 1.25
    v = x.clone()
    v[:, :, 7, :] = -0.5
    m = build_method("kivi:bits=2")
    k_hat, _ = m.compress(k, 0, "k")
    v_hat, _ = m.compress(v, 0, "v")
    assert torch.equal(k_hat[..., 5], k[..., 5])
    assert torch.equal(v_hat[:, :, 7], v[:, :, 7])


def test_fp8_error_is_relative_to_the_head_scale():
    x = _x(3)
    x[:, 0] *= 100.0  # head 0 much larger than head 1
    x_hat, _ = build_method("fp8").compress(x, 0, "k")
    for h in range(H):
        amax = x[:, h].abs().amax()
        # e4m3 has 3 mantissa bits: relative error <= 2^-4 above the subnormal range
        err = (x_hat[:, h] - x[:, h]).abs()
        assert bool((err <= x[:, h].abs() / 16 + amax / 448 * 2**-6).all())


def test_lloyd_max_codebooks():
    for bits in (1, 2, 3, 4):
        c = lloyd_max_sphere(64, bits)
        assert len(c) == 2**bits
        assert all(a < b for a, b in zip(c, c[1:]))
        assert c == pytest.approx(-c[::-1], abs=1e-3)
    # d = 64 coordinates are close to N(0, 1/64): the Gaussian 2-bit centroids are 0.4528, 1.510
    assert 8 * lloyd_max_sphere(64, 2)[2:] == pytest.approx([0.4528, 1.510], rel=0.02)


@pytest.mark.parametrize(("bits", "lo", "hi"), [(1, 0.33, 0.39), (2, 0.10, 0.13), (3, 0.027, 0.04)])
def test_turboquant_mse_matches_the_paper(bits, lo, hi):
    # TurboQuant's distortion for unit vectors: about 0.36, 0.117, 0.03 at 1, 2, 3 bits
    x = _x(4, (1, 4, 2000, 64))
    x_hat, _ = build_method(f"turboquant:bits={bits}").compress(x, 0, "k")
    rel = ((x_hat - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    assert lo < rel < hi


def test_turboquant_qjl_keeps_inner_products_unbiased():
    x = _x(5, (1, 1, 4000, 64))
    q = _x(6, (64,))
    x_hat, _ = build_method("turboquant:bits=2,qjl=1").compress(x, 0, "k")
    err = (x_hat - x) @ q
    # unbiased: the mean error is small against its spread
    assert abs(err.mean().item()) < 4 * err.std().item() / math.sqrt(err.numel())


@pytest.mark.parametrize(
    ("spec", "per_stream"),
    [
        ("hf-hqq:bits=4", H * T * D // 2 + H * T * D // 64 * 4),
        ("hf-hqq:bits=2,group=32", H * T * D // 4 + H * T * D // 32 * 4),
        ("hf-fp8", H * T * D + 4),
    ],
)
def test_transformers_quantized_cache_bytes(spec, per_stream):
    from transformers import LlamaConfig

    m = build_method(spec)
    if m.reason:
        pytest.skip(m.reason)
    cfg = LlamaConfig(num_hidden_layers=1, num_key_value_heads=H, num_attention_heads=H, head_dim=D)
    cache = m.make_cache(cfg)
    x = _x(7, (1, H, T, D))
    cache.update(x, x.clone(), 0)
    counted, allocated = m.count(cache.layers[0])
    assert sum(counted["k"].values()) == per_stream
    assert sum(counted["v"].values()) == per_stream
    assert allocated >= 2 * per_stream * 0.9


def test_hqq_three_bits_is_skipped_with_a_reason():
    m = build_method("hf-hqq:bits=3")
    assert m.reason
