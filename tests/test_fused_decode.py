"""The Triton decoder of a run of coded blocks (``fused_decode.py``), which decodes on a GPU in
place of the torch ops: it must give the torch decoder's values bit for bit (so the codec's),
and a failing kernel must leave the torch decoder in charge. Run here in Triton's interpreter
on the CPU (``TRITON_INTERPRET=1``, which must be set before Triton is imported: a fresh
process); tests/test_cuda.py runs the compiled kernel where a GPU is present."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kakeyaturbo import fused_decode
from kakeyaturbo.device_decode import PackedRun

pytestmark = pytest.mark.skipif(fused_decode.triton is None, reason="Triton is not installed")

# Blocks of every width from 0 to 8 bits, outliers, runs of 256 and 188 vectors, a joint width
# (192) that is not a power of two, keys and values.
INTERPRETED = textwrap.dedent(
    """
    import dataclasses, torch
    from kakeyaturbo import fused_decode
    from kakeyaturbo.device_decode import DeviceBlocks
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
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "runs checked 16" in done.stdout


def _run() -> PackedRun:
    from kakeyaturbo.device_decode import DeviceBlocks
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

    def broken(_run):
        raise RuntimeError("no such device function")

    monkeypatch.setattr(fused_decode, "decode", broken)
    with pytest.warns(RuntimeWarning, match="failed on cpu"):
        assert not fused_decode._agrees(run)
    monkeypatch.setattr(fused_decode, "decode", lambda r: r.decode_with_torch() + 1.0)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert not fused_decode._agrees(run)
    monkeypatch.setattr(fused_decode, "decode", lambda r: r.decode_with_torch())
    assert fused_decode._agrees(run)
