"""The torch decoder of coded blocks (``device_decode.py``), which attention off the CPU kernels
decodes with on the model's device: it must give the codec's own decode bit for bit, hold what
it says, and refuse layers it cannot read. Run here on the CPU (torch's ops are the same on a
GPU; tests/gpu/test_cuda.py runs it there where one is present)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo import _core
from kakeyaturbo.gpu.device_decode import DeviceBlocks, PackedRun
from kakeyaturbo.pipeline import Pipeline, decode_blocks
from kakeyaturbo.recipes import default_recipe

CPU = torch.device("cpu")


def _states(seed: int, rows: int = 2, heads: int = 3, tokens: int = 700, d: int = 64):
    """Keys/values with a decaying spectrum, so water-filling gives components every width
    from 0 up, and one token far out, so the blocks hold outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, tokens, d, generator=g) * torch.linspace(0.05, 4.0, d)
    x[0, heads - 1, 5, 3] = 300.0
    return x


@pytest.mark.parametrize("bits", [0.75, 2.6, 6.5])
@pytest.mark.parametrize("stream", ["k", "v"])
def test_decodes_the_codecs_values_bit_for_bit(stream, bits):
    recipe = default_recipe()
    params = getattr(recipe, stream).replace(bits_per_value=bits)
    pipe = Pipeline(dataclasses.replace(recipe, **{stream: params}))
    blocks = pipe.encode(_states(1), 0, stream)
    assert [b.tokens for b in blocks] == [256, 256, 188]  # two runs of equal blocks
    widths = {
        int(w) for b in blocks for e in b.encs for w in _core.waterfill_sections(e._raw)[0]["bits"]
    }
    outliers = sum(s["n_outliers"] for b in blocks for e in b.encs for s in e.stats)
    assert outliers > 0
    assert (8 in widths) if bits > 6 else (0 in widths)
    held = DeviceBlocks.of(blocks, CPU)
    got = held.decode(2)
    want = decode_blocks(blocks, 2)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    y, scale = pipe.decode_codes(held, stream, 2)
    y_ref, scale_ref = pipe.decode_codes(blocks, stream, 2)
    assert torch.equal(y, y_ref)
    assert (scale is None) == (scale_ref is None)
    if scale is not None:
        assert torch.equal(scale, scale_ref)


def test_holds_the_stored_bytes_and_counts_them():
    pipe = Pipeline(default_recipe())
    blocks = pipe.encode(_states(2), 0, "k")
    held = DeviceBlocks.of(blocks, CPU)
    # Every tensor a run holds, whatever its fields: a field left out of nbytes shows here.
    tensors = [
        getattr(run, f.name)
        for run, _ in held.runs
        for f in dataclasses.fields(run)
        if isinstance(getattr(run, f.name), torch.Tensor)
    ]
    tensors += [t for run in held.norms.runs for t in run] if held.norms is not None else []
    assert held.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    stored = sum(b.nbytes for b in blocks)
    # The packed codes and side values as stored; the per-block header and checksum are not
    # copied; three int64 per stream-block, a byte per component's width (4 bits stored),
    # and the outliers' positions and values widened are added. (Each component's first bit
    # as int32 was 5% more.)
    assert 0.97 * stored < held.nbytes < 1.03 * stored


def test_refuses_layers_it_cannot_read():
    x = torch.randn(300, 64)
    with pytest.raises(ValueError, match="water-filled"):
        _core.waterfill_sections(kt.encode_layer(x, kt.CodecParams(pca_method="none"))._raw)
    with pytest.raises(ValueError, match="without a basis"):
        _core.waterfill_sections(
            kt.encode_layer(x, kt.CodecParams(allocation="waterfill", k=0))._raw
        )
    encs = [kt.encode_layer(torch.randn(n, 64), default_recipe().k) for n in (256, 200)]
    with pytest.raises(ValueError, match="different numbers of vectors"):
        PackedRun.of(encs, CPU)


@pytest.mark.parametrize("metric", ["mse", "inner_product"])
def test_decodes_any_waterfill_layer_without_a_basis(metric):
    # The inner-product metric's reconstruction gain per width, which the recipes do not use.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, 40, generator=g) * torch.linspace(0.1, 3.0, 40)
    params = default_recipe().k.replace(metric=metric, block_size=300)
    encs = kt.encode_batch(x, params)
    got = PackedRun.of(encs, CPU).decode()
    assert torch.equal(got, torch.as_tensor(kt.decode_batch(encs)))


def _assert_laid_out_alike(got: DeviceBlocks, want: DeviceBlocks) -> None:
    """Every tensor ``got`` holds equals ``want``'s, dtype included, run by run."""
    assert (got.streams, got.tokens, len(got.runs)) == (want.streams, want.tokens, len(want.runs))
    for (run, count), (ref, ref_count) in zip(got.runs, want.runs):
        assert (count, run.n) == (ref_count, ref.n)
        for f in dataclasses.fields(run):
            a, b = getattr(run, f.name), getattr(ref, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), f.name
    assert (got.norms is None) == (want.norms is None)
    if want.norms is not None:
        assert len(got.norms.runs) == len(want.norms.runs)
        for run, ref in zip(got.norms.runs, want.norms.runs):
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(run, ref))


@pytest.mark.parametrize("heads", [3, 1])
@pytest.mark.parametrize("stream", ["k", "v"])
def test_blocks_joined_taken_and_reordered_on_the_device_are_laid_out_as_built(stream, heads):
    # A cache that holds its blocks only on the device adds a flush's blocks, crops and
    # reorders beams from what the device holds: each must give what laying out the same
    # blocks from their host copies gives, tensor for tensor (so decoding them does too).
    blocks = Pipeline(default_recipe()).encode(_states(4, heads=heads, tokens=956), 0, stream)
    assert [b.tokens for b in blocks] == [256, 256, 256, 188]
    assert sum(s["n_outliers"] for b in blocks for e in b.encs for s in e.stats) > 0
    held = DeviceBlocks.of(blocks, CPU)
    if stream == "v":
        assert held.norms is not None  # the default recipe's values keep token norms
    parts = [DeviceBlocks.of(blocks[i:j], CPU) for i, j in ((0, 1), (1, 3), (3, 4))]
    _assert_laid_out_alike(DeviceBlocks.joined(parts), held)
    _assert_laid_out_alike(DeviceBlocks.joined(parts[1:]), DeviceBlocks.of(blocks[1:], CPU))
    for picked in ([1], [0, 2], [3, 0], [0, 1, 2]):
        want = DeviceBlocks.of([blocks[i] for i in picked], CPU)
        _assert_laid_out_alike(held.take(picked), want)
    for order in ([1, 0], [1], [0, 0, 1, 1]):
        want = DeviceBlocks.of([b.select_rows(order, 2) for b in blocks], CPU)
        got = held.take(range(4), rows=2, order=order)
        _assert_laid_out_alike(got, want)
        assert torch.equal(got.decode(len(order)), decode_blocks(blocks, 2)[order])
