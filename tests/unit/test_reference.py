"""The Rust codec against the independent numpy reference (``tests/support/numpy_reference.py``):
same rate (byte for byte, up to the 6 bytes of each outlier), statistically the same
distortion; plus the WHT rotation against an explicit Hadamard matrix and the Gaussian
Lloyd-Max codebooks against Max's published optimum distortions. Synthetic data only."""

from __future__ import annotations

import numpy as np
import numpy_reference as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kakeyaturbo as kt
from kakeyaturbo import _core

N_TOKENS, HEAD_DIM = 1024, 64  # two blocks of 512


def rel_err(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def kv_like(n: int, d: int, seed: int) -> np.ndarray:
    """KV-cache-like rows: decaying spectrum in a random frame, a non-zero mean, a few
    large channels and periodic "sink" tokens of much larger norm."""
    rng = np.random.default_rng(seed)
    frame = np.linalg.qr(rng.standard_normal((d, d)))[0]
    z = rng.standard_normal((n, d)) * (4.0 / (1.0 + np.arange(d)) ** 0.7)
    x = z @ frame.T + 1.5
    x[:, :3] *= 6.0
    x[::97] *= 5.0
    return x.astype(np.float32)


def iid_gaussian(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


DATA = {"kv_like": kv_like, "iid_gaussian": iid_gaussian}


def n_outliers(stats: list[dict]) -> int:
    return sum(s["n_outliers"] for s in stats)


@pytest.mark.parametrize("k", [0, 16])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("data", sorted(DATA))
def test_rust_matches_reference_rate_and_distortion(data, bits, k):
    x = DATA[data](N_TOKENS, HEAD_DIM, seed=bits * 10 + k)
    p = kt.CodecParams(bit_width=bits, k=k)

    enc = kt.encode_layer(x, p)
    err_rust = rel_err(x, kt.decode_layer(enc))
    renc = ref.encode_layer(x, p)
    err_ref = rel_err(x, ref.decode_layer(renc))

    # Distortion: the same within 10% (relative); in practice within ~2%.
    assert abs(err_rust - err_ref) <= 0.10 * err_ref, (err_rust, err_ref)

    # Rate: identical structure, and bytes equal up to 6 per outlier of difference.
    assert [(s["n"], s["d_eff"], s["k_used"]) for s in enc.stats] == [
        (s["n"], s["d_eff"], s["k_used"]) for s in renc.stats
    ]
    d_out = n_outliers(enc.stats) - n_outliers(renc.stats)
    assert enc.nbytes - renc.nbytes == ref.OUTLIER_BYTES * d_out
    # The reference's wire accounting reproduces the Rust size from the Rust stats.
    assert ref.layer_nbytes(enc.stats, p, HEAD_DIM) == enc.nbytes == len(enc.to_bytes())


@pytest.mark.parametrize("metric", ["mse", "inner_product"])
def test_block_round_trip_and_options(metric):
    """One block with non-default options: bytes of a one-block layer and distortion."""
    x = kv_like(300, 48, seed=7)  # d_eff = 48 pads to W = 64
    p = kt.CodecParams(bit_width=3, k=8, metric=metric, skeleton_dtype="bf16", rank_cap=40)
    enc = kt.encode_block(x, p)
    x_hat, nbytes = ref.encode_decode_block(x, p)
    assert x_hat.shape == x.shape and x_hat.dtype == np.float32
    renc = ref.encode_layer(x, p)
    d_out = n_outliers(enc.stats) - n_outliers(renc.stats)
    assert nbytes == renc.nbytes
    assert enc.nbytes - nbytes == ref.OUTLIER_BYTES * d_out
    err_rust, err_ref = rel_err(x, kt.decode_block(enc)), rel_err(x, x_hat)
    assert abs(err_rust - err_ref) <= 0.10 * err_ref, (err_rust, err_ref)


def test_shared_basis_and_weights_accounting():
    x = kv_like(700, 32, seed=3)
    w = np.random.default_rng(3).uniform(0.0, 2.0, 700).astype(np.float32)
    p = kt.CodecParams(bit_width=2, k=4, share_basis=True, block_size=256)
    enc = kt.encode_layer(x, p, weights=w)
    renc = ref.encode_layer(x, p, w)
    d_out = n_outliers(enc.stats) - n_outliers(renc.stats)
    assert enc.nbytes - renc.nbytes == ref.OUTLIER_BYTES * d_out
    err_rust, err_ref = rel_err(x, kt.decode_layer(enc)), rel_err(x, ref.decode_layer(renc))
    assert abs(err_rust - err_ref) <= 0.10 * err_ref, (err_rust, err_ref)


@pytest.mark.parametrize(
    "opts", [{}, {"k": 0, "bit_width": 4}, {"metric": "inner_product", "bit_width": 2, "k": 4}]
)
def test_identity_basis_reproduces_rust_almost_exactly(opts):
    """With pca_method 'none' there is no eigenvector sign ambiguity and the reference uses
    the Rust random streams, so the two decode to nearly the same values (only rare
    quantiser-boundary or f16-rounding ties differ) at exactly the same size."""
    try:
        p = kt.CodecParams(pca_method="none", **opts)
    except ValueError:
        pytest.skip("this build of the Rust core has no pca_method='none'")
    x = kv_like(1100, 64, seed=11)
    enc, renc = kt.encode_layer(x, p), ref.encode_layer(x, p)
    d_out = n_outliers(enc.stats) - n_outliers(renc.stats)
    assert enc.nbytes - renc.nbytes == ref.OUTLIER_BYTES * d_out
    assert [s["d_eff"] for s in enc.stats] == [64, 64, 64]
    diff = np.abs(kt.decode_layer(enc) - ref.decode_layer(renc))
    assert diff.max() <= 1e-3 * np.abs(x).max()
    assert np.mean(diff > 1e-5 * np.abs(x).max()) < 0.01


@pytest.mark.parametrize("metric", ["mse", "inner_product"])
def test_scale_refit_metric(metric):
    """Both implementations: the inner-product scale makes <r_hat, r> = |r|^2 per vector
    (no shrinkage of q . k); the MSE scale shrinks by about 1 - D(bits)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((512, 64)) * np.linspace(3.0, 0.2, 64) + 0.7).astype(np.float32)
    p = kt.CodecParams(
        bit_width=2, k=0, metric=metric, skeleton_dtype="fp32", outlier_threshold=float("inf")
    )
    r = x - x.mean(axis=0)
    for x_hat in (kt.decode_layer(kt.encode_layer(x, p)), ref.encode_decode_layer(x, p)[0]):
        gain = np.einsum("ij,ij->i", r, x_hat - x.mean(axis=0)) / np.einsum("ij,ij->i", r, r)
        if metric == "inner_product":
            np.testing.assert_allclose(gain, 1.0, atol=2e-3)  # f16 scale rounding
        else:
            assert abs(gain.mean() - (1 - 0.1175)) < 0.02, gain.mean()


@pytest.mark.parametrize(
    "opts",
    [
        {"allocation": "waterfill", "k": 0},
        {"pca_method": "randomized"},
    ],
)
def test_reference_refuses_what_it_does_not_implement(opts):
    """The reference codes the uniform allocation with exact or no PCA; anything else is
    refused, never silently coded another way (it would compare against the wrong thing)."""
    p = kt.CodecParams(**opts)
    x = kv_like(64, 16, seed=1)
    with pytest.raises(NotImplementedError, match=next(iter(opts.values()))):
        ref.encode_layer(x, p)
    with pytest.raises(NotImplementedError):
        ref.encode_block(x, p)
    with pytest.raises(NotImplementedError):
        ref.layer_nbytes(kt.encode_layer(x, p).stats, p, 16)


def hadamard(n: int) -> np.ndarray:
    """Sylvester-Hadamard matrix (entries ±1, H H = n I) by explicit Kronecker products."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def rotate(x: np.ndarray, seed: int, inverse: bool = False) -> np.ndarray:
    return np.asarray(_core.wht_rotate(x.astype(np.float32).tolist(), seed, inverse))


@settings(max_examples=25, deadline=None)
@given(
    log_n=st.integers(0, 8),
    seed=st.integers(0, 2**64 - 1),
    vals=st.lists(st.floats(-100.0, 100.0, width=32), min_size=256, max_size=256),
)
def test_wht_rotation_is_the_explicit_orthonormal_hadamard(log_n, seed, vals):
    n = 1 << log_n
    h = hadamard(n)
    # The whole rotation matrix, column by column from one-hot inputs.
    r = np.stack([rotate(e, seed) for e in np.eye(n)], axis=1)
    # One-hot inputs spread evenly: every coordinate has magnitude exactly 1/sqrt(n).
    np.testing.assert_allclose(np.abs(r), 1.0 / np.sqrt(n), rtol=1e-6)
    # R = H diag(s) / sqrt(n) with ±1 signs, the reference's SplitMix64 signs.
    signs = np.sign(r[0]) * np.sign(h[0])
    np.testing.assert_array_equal(signs, ref.wht_signs(n, seed))
    np.testing.assert_allclose(r, h * signs / np.sqrt(n), atol=1e-6)
    np.testing.assert_allclose(r.T @ r, np.eye(n), atol=1e-5)  # orthonormal

    x = np.asarray(vals[:n], dtype=np.float32)
    tol = 1e-4 * max(1.0, float(np.abs(x).max()))  # f32 butterfly rounding, log2(n) stages
    y = rotate(x, seed)
    np.testing.assert_allclose(y, h @ (signs * x) / np.sqrt(n), atol=tol)
    nx, ny = float(x.astype(np.float64) @ x), float(y.astype(np.float64) @ y)
    assert abs(nx - ny) <= 1e-4 * max(nx, 1.0)  # norm preserved
    back = rotate(y, seed, inverse=True)
    np.testing.assert_allclose(back, x, atol=tol)  # exact inverse
    # The reference's vectorised butterfly is the same transform.
    np.testing.assert_allclose(ref.fwht(signs * x) / np.sqrt(n), y, atol=1e-4 * max(1.0, ny**0.5))


@pytest.mark.parametrize("bits, published", [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_gaussian_codebook_distortion_matches_max_1960(bits, published):
    levels = kt.gaussian_codebook(bits).astype(np.float64)
    assert levels.shape == (2**bits,) and np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-6)  # symmetric
    z = np.random.default_rng(12345).standard_normal(1_000_000)
    bounds = 0.5 * (levels[1:] + levels[:-1])
    mse = float(np.mean((z - levels[np.searchsorted(bounds, z)]) ** 2))
    assert abs(mse - published) <= 0.02 * published, (bits, mse, published)
