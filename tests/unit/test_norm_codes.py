"""Token norms in one byte (norm_codes.py): error bound, zeros, bytes, concatenation."""

from __future__ import annotations

import math

import torch

from kakeyaturbo.norm_codes import STEPS, decode_norms, encode_norms


def _norms(span_octaves: float, shape=(2, 3, 256), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lg = torch.rand(shape, generator=g) * span_octaves - span_octaves / 2
    return torch.exp2(lg).half()


def test_relative_error_is_half_a_step_of_the_streams_own_span():
    for span in (0.5, 4.0, 8.0, 20.0):
        n = _norms(span)
        got = encode_norms(n).decode()
        rel = ((got - n.float()) / n.float()).abs()
        lo, hi = n.float().amin(-1), n.float().amax(-1)
        half_step = torch.exp2((hi / lo).log2() / STEPS / 2) - 1  # per stream
        # float16 rounding of the bounds adds at most 2^-11 relative.
        assert bool((rel <= half_step[..., None] + 2**-10).all()), span
    # The documented bound: 1.1% for a stream spanning 8 octaves.
    assert math.exp2(8 / STEPS / 2) - 1 < 0.011


def test_zeros_stay_zero_and_extremes_are_exact():
    n = _norms(6.0)
    n[0, 1, 7] = 0
    n[1, 2, :] = 0  # an all-zero stream
    codes = encode_norms(n)
    got = codes.decode()
    assert got[0, 1, 7] == 0 and bool((got[1, 2] == 0).all())
    assert int(codes.codes[0, 1, 7]) == 0 and bool((codes.codes[1, 2] == 0).all())
    # Each stream's smallest and largest norm come back to float16 rounding.
    real = n[0, 0].float()
    assert torch.allclose(got[0, 0].min(), real.min(), rtol=2**-10)
    assert torch.allclose(got[0, 0].max(), real.max(), rtol=2**-10)
    assert bool(torch.isfinite(got).all())


def test_norms_below_float16_range_decode_finite():
    n = torch.tensor([[[1e-9, 1e-3, 0.5, 3e4]]])
    got = encode_norms(n).decode()
    assert bool(torch.isfinite(got).all()) and bool((got > 0).all())
    assert torch.allclose(got[..., 1:], n[..., 1:], rtol=0.05)


def test_bytes_are_a_byte_per_token_and_two_float16_per_stream():
    codes = encode_norms(_norms(4.0, shape=(2, 3, 100)))
    assert codes.codes.dtype == torch.uint8 and codes.bounds.dtype == torch.float16
    held = sum(t.untyped_storage().nbytes() for t in (codes.codes, codes.bounds))
    assert codes.nbytes == held == 2 * 3 * 100 + 2 * 3 * 2 * 2


def test_blocks_decode_together_as_apart_and_rows_select():
    a, b = _norms(5.0, seed=1), _norms(3.0, shape=(2, 3, 40), seed=2)
    ca, ca2, cb = encode_norms(a), encode_norms(_norms(2.0, seed=3)), encode_norms(b)
    # A run of equal-length blocks, then a shorter one: each token keeps its own block's bounds.
    together = decode_norms([ca, ca2, cb, ca])
    apart = [ca.decode(), ca2.decode(), cb.decode(), ca.decode()]
    assert torch.equal(together, torch.cat(apart, dim=-1))
    picked = ca.select_rows(torch.tensor([1, 1, 0]))
    assert torch.equal(picked.decode(), ca.decode()[[1, 1, 0]])
