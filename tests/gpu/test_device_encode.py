"""The torch encoder of coded blocks (``device_encode.py``), which a cache holding its blocks on
the model's device codes with there: it must give the codec's own blocks as the device decoder
holds them, byte for byte, and refuse what the codec refuses. Run here on the CPU (torch's ops
are the same on a GPU; tests/gpu/test_cuda.py runs it there where one is present)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo import _core
from kakeyaturbo.gpu import device_encode
from kakeyaturbo.gpu.device_decode import DeviceBlocks, PackedRun
from kakeyaturbo.gpu.device_encode import encode_run
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import default_recipe

CPU = torch.device("cpu")


def _streams(seed: int, k: int = 6, n: int = 256, d: int = 64) -> torch.Tensor:
    """Streams with a decaying spectrum (every width from 0 to 8 at high rates), heavy tails
    (outliers), a component that is constant (scale 0), two equal ones (equal gains: the
    allocation's ties) and one of -1, 0, 1 (mean 0: zeros fall on the codebooks' middle bound,
    where ties go up)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, n, d, generator=g) * torch.logspace(-2, 1.3, d)
    x += torch.randn(k, 1, d, generator=g)  # a mean per stream
    x[:, :, 0] = 1.5  # constant: scale 0, no bits, no outliers
    x[:, :, 2] = x[:, :, 1]
    x[:, :, 3] = torch.tensor([-1.0, 0.0, 1.0, 0.0]).repeat(n // 4)
    x[0, 7, 5] = 900.0
    x[1] = x[1] * torch.randn(n, 1, generator=g).pow(3).clamp(-40, 40)  # heavy tails
    return x


def _assert_same_run(got: PackedRun, want: PackedRun) -> None:
    assert got.n == want.n
    for f in dataclasses.fields(got):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, f.name
            assert torch.equal(a, b), f.name


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"bits_per_value": 1.25},
        {"bits_per_value": 7.5},  # components of 8 bits, the widest
        {"bits_per_value": 0.3},  # fewer bits than components
        {"skeleton_dtype": "bf16"},
        {"skeleton_dtype": "fp32", "metric": "inner_product"},
        {"outlier_threshold": 1.5},  # many outliers
        {"outlier_threshold": float("inf")},  # none
    ],
)
def test_codes_the_codecs_blocks_byte_for_byte(change):
    params = default_recipe().k.replace(block_size=256, **change)
    x = _streams(1)
    want = PackedRun.of(kt.encode_batch(x, params), CPU)
    got = encode_run(x, params)
    _assert_same_run(got, want)
    assert torch.equal(got.decode(), want.decode())


@pytest.mark.parametrize("shape", [(1, 1, 5), (3, 7, 3), (2, 300, 192), (2, 64, 256)])
def test_any_shape_codes_as_the_codec_does(shape):
    # One vector (scale 0 everywhere), a few, joint streams' width, head_dim 256; vector
    # counts that are not whole tiles of the decoder's.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g) * torch.linspace(0.1, 5.0, shape[-1])
    params = default_recipe().v.replace(block_size=shape[1])
    _assert_same_run(encode_run(x, params), PackedRun.of(kt.encode_batch(x, params), CPU))


def test_a_long_span_is_coded_in_pieces_laid_out_as_one(monkeypatch):
    monkeypatch.setattr(device_encode, "CHUNK_VALUES", 2 * 256 * 64)  # two streams at a time
    params = default_recipe().k.replace(block_size=256, outlier_threshold=2.5)
    x = _streams(3, k=5)
    _assert_same_run(encode_run(x, params), PackedRun.of(kt.encode_batch(x, params), CPU))


def test_streams_coded_together_each_at_its_own_rate():
    # Several layers' streams in one call (a cache flushing every layer at once), each at its
    # layer's bits per value: the same as each coded alone.
    x = _streams(4, k=4)
    base = default_recipe().k.replace(block_size=256)
    params = [base.replace(bits_per_value=r) for r in (2.5, 1.75, 2.5, 4.0)]
    encs = [kt.encode_batch(x[i : i + 1], p)[0] for i, p in enumerate(params)]
    _assert_same_run(encode_run(x, params), PackedRun.of(encs, CPU))
    with pytest.raises(ValueError, match="3 CodecParams for 4 streams"):
        encode_run(x, params[:3])
    with pytest.raises(ValueError, match="more than bits_per_value"):
        encode_run(x, [*params[:3], params[3].replace(outlier_threshold=3.0)])


def test_scales_round_to_float16_as_the_codec_stores_them():
    # This stream's scale, 1.46240234..., rounds to float16 1.463 through float32 (the codec's
    # rule on every machine) and to 1.462 at once: each rounding must be the codec's.
    x = torch.tensor(
        [1.6767759323120117, -0.6035685539245605, 2.820655107498169, -0.519212007522583]
    )
    params = default_recipe().k.replace(block_size=4)
    got, want = encode_run(x[None, :, None], params), kt.encode_batch(x[None, :, None], params)
    assert got.sigma.item() == PackedRun.of(want, CPU).sigma.item() == 1.462890625


def test_refuses_what_the_codec_refuses():
    params = default_recipe().k.replace(block_size=16)
    x = torch.randn(2, 16, 8)
    bad = x.clone()
    bad[1, 3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite value at vector 3, dim 4"):
        encode_run(bad, params)
    with pytest.raises(ValueError, match="non-finite"):
        kt.encode_batch(bad, params)
    big = x.clone()
    big[0, 2, 1] = 1e6
    with pytest.raises(ValueError, match="magnitude 1e\\+06 at vector 2, dim 1"):
        encode_run(big, params)
    with pytest.raises(ValueError, match="float32"):
        encode_run(x.double(), params)
    with pytest.raises(ValueError, match="0 vectors"):
        encode_run(x[:, :0], params)
    with pytest.raises(ValueError, match="without a basis"):
        encode_run(x, params.replace(pca_method="exact"))
    with pytest.raises(ValueError, match="without a basis"):
        encode_run(x, kt.CodecParams(pca_method="none"))  # uniform allocation
    with pytest.raises(ValueError, match=r"parts of \[1, 2\] stream-blocks for 2"):
        device_encode.encode_runs(x, params, [1, 2])
    with pytest.raises(ValueError, match="parts of"):
        device_encode.encode_runs(x, params, [2, 0])
    assert len(device_encode.encode_runs(x, params, [1, 1])) == 2


def test_distortion_table_is_the_codecs():
    d = _core.gaussian_distortions()
    assert len(d) == 9 and d[0] == 1.0
    assert all(a > b > 0 for a, b in zip(d, d[1:]))
    assert abs(d[1] - (1 - 2 / torch.pi)) < 1e-9  # 1-bit Lloyd-Max: 1 - 2/pi


@pytest.mark.parametrize("stream", ["k", "v"])
def test_pipeline_codes_on_the_device_as_it_codes_on_the_host(stream):
    # Self-fitted frames, sinks, token norms (the default recipe's values): the blocks a cache
    # holding them on its device codes there are those it would have copied there.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 512, 64, generator=g) * torch.linspace(0.05, 4.0, 64)
    sinks = torch.zeros(2, 512, dtype=torch.bool)
    sinks[:, :4] = True
    want = Pipeline(default_recipe()).encode(x, 0, stream, sinks=sinks)
    got = Pipeline(default_recipe()).encode_on_device(x, 0, stream, sinks=sinks)
    ref = DeviceBlocks.of(want, CPU)
    assert (got.streams, got.tokens, len(got.runs)) == (ref.streams, ref.tokens, 1)
    _assert_same_run(got.runs[0][0], ref.runs[0][0])
    assert got.runs[0][1] == ref.runs[0][1] == 2
    assert (got.norms is None) == (ref.norms is None) == (stream == "k")
    if got.norms is not None:
        for a, b in zip(got.norms.runs[0], ref.norms.runs[0]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        Pipeline(default_recipe()).encode_on_device(x[:, :, :300], 0, stream)
