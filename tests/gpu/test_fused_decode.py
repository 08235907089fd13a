"""The Triton decoder of a run of coded blocks (``fused_decode.py``), which decodes on a GPU in
place of the torch ops: it must give the torch decoder's values bit for bit (so the codec's),
and a failing kernel must leave the torch decoder in charge. Run here in Triton's interpreter
on the CPU (``TRITON_INTERPRET=1``, which must be set before Triton is imported: a fresh
process); tests/gpu/test_cuda.py runs the compiled kernel where a GPU is present."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import assert_twin_checked  # tests/support (pythonpath)
from triton_interpreter import run_interpreted  # tests/support (pythonpath)

from kakeyaturbo.gpu import fused_decode
from kakeyaturbo.gpu.device_decode import PackedRun

pytestmark = pytest.mark.skipif(fused_decode.triton is None, reason="Triton is not installed")

# Blocks of every width from 0 to 8 bits, outliers, runs of 256 and 188 vectors, a joint width
# (192) that is not a power of two, keys and values.
INTERPRETED = textwrap.dedent(
    """
    import dataclasses, torch
    from kakeyaturbo.gpu import fused_decode
    from kakeyaturbo.gpu.device_decode import DeviceBlocks
    from kakeyaturbo.pipeline import Pipeline
    from kakeyaturbo.recipes import default_recipe

    g = torch.Generator().manual_seed(3)
    checked = 0
    for d, bits in ((64, 0.75), (64, 2.6), (192, 2.5), (64, 6.5)):
        x = torch.randn(2, 3, 700, d, generator=g) * torch.linspace(0.05, 4.0, d)
        x[0, 1, 5, 3] = 300.0
        for stream in ("k", "v"):
            recipe = default_recipe()
            params = getattr(recipe, stream).replace(bits_per_value=bits)
            pipe = Pipeline(dataclasses.replace(recipe, **{stream: params}))
            held = DeviceBlocks.of(pipe.encode(x, 0, stream), torch.device("cpu"))
            for run, _ in held.runs:
                got, want = fused_decode.decode(run), run.decode_with_torch()
                assert got.shape == want.shape and torch.equal(got, want), (d, bits, stream)
                checked += 1
    print("runs checked", checked)
    """
)


def test_the_kernel_decodes_the_torch_decoders_bits_in_the_interpreter():
    assert "runs checked 16" in run_interpreted(INTERPRETED)


# Token norms over 10 octaves with exact zeros, a stream of zeros only, runs of two 256-token
# blocks and of one 188-token block: within the tolerance of torch's ops, zeros exactly zero.
NORMS = textwrap.dedent(
    """
    import torch
    from kakeyaturbo.gpu import fused_decode
    from kakeyaturbo.norm_codes import StackedNorms, decode_run_with_torch, encode_norms

    g = torch.Generator().manual_seed(5)
    n = (torch.randn(2, 3, 700, generator=g) * 1.7).exp()
    n[0, 1, 5:40] = 0.0
    n[1, 2] = 0.0
    held = StackedNorms.of([encode_norms(n[..., i : i + 256]) for i in range(0, 700, 256)])
    for run in held.runs:
        got, want = fused_decode.decode_norms(*run), decode_run_with_torch(*run)
        assert got.shape == want.shape and torch.equal(got == 0, want == 0)
        assert ((got - want).abs() <= fused_decode.NORM_TOLERANCE * want.abs()).all()
        assert fused_decode.norms_close(*run, decode_run_with_torch)
    print("norm runs checked", len(held.runs))
    """
)


def test_the_norm_kernel_decodes_the_torch_norms_in_the_interpreter():
    assert "norm runs checked 2" in run_interpreted(NORMS)


def test_a_norm_kernel_that_disagrees_is_dropped_and_the_cpu_uses_torch(monkeypatch):
    from kakeyaturbo.norm_codes import StackedNorms, decode_run_with_torch, encode_norms

    norms = torch.rand(1, 2, 300, generator=torch.Generator().manual_seed(6)) + 0.5
    run = StackedNorms.of([encode_norms(norms)]).runs[0]
    assert not fused_decode.norms_usable(*run, decode_run_with_torch)  # the CPU
    assert torch.allclose(StackedNorms.of([encode_norms(norms)]).decode(), norms, rtol=0.02)

    def agrees() -> bool:
        check = lambda: fused_decode.norms_close(*run, decode_run_with_torch)  # noqa: E731
        return fused_decode.NORMS.agrees(run[0].device, check)

    off = lambda *a: decode_run_with_torch(*a) * (1 + 4 * fused_decode.NORM_TOLERANCE)  # noqa: E731
    monkeypatch.setattr(fused_decode, "decode_norms", off)
    with pytest.warns(RuntimeWarning, match="norm decoder disagrees"):
        assert not agrees()
    monkeypatch.setattr(fused_decode, "decode_norms", decode_run_with_torch)
    assert agrees()


def _run() -> PackedRun:
    from kakeyaturbo.gpu.device_decode import DeviceBlocks
    from kakeyaturbo.pipeline import Pipeline
    from kakeyaturbo.recipes import default_recipe

    x = torch.randn(1, 1, 300, 64, generator=torch.Generator().manual_seed(4))
    blocks = Pipeline(default_recipe()).encode(x, 0, "k")
    return DeviceBlocks.of(blocks, torch.device("cpu")).runs[0][0]


def test_off_a_gpu_the_torch_ops_decode():
    run = _run()
    assert not fused_decode.usable(run)  # the CPU: torch ops, whatever Triton is
    assert torch.equal(run.decode(), run.decode_with_torch())


def test_a_kernel_that_fails_or_disagrees_is_dropped_with_a_warning(monkeypatch):
    run = _run()
    check = lambda: fused_decode.same_bits(run)  # noqa: E731
    twin = lambda r: r.decode_with_torch()  # noqa: E731
    kernel, device = fused_decode.KERNEL, run.codes.device
    assert_twin_checked(monkeypatch, fused_decode, "decode", kernel, device, check, twin)
