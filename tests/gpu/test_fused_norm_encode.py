"""The Triton norm encoder (``fused_norm_encode.py``), which codes a flush's token norms on a GPU
in place of the torch ops: its codes must be torch's to the tolerance its log2 leaves (every
code within one, zeros exact, the bounds' logs within TOLERANCE), and a failing kernel must
leave the torch ops in charge. Run here in Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, set before Triton is imported: a fresh process); tests/gpu/test_cuda.py
runs the compiled kernel where a GPU is present."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import assert_dropped_unless_it_agrees  # tests/support (pythonpath)
from triton_interpreter import run_interpreted  # tests/support (pythonpath)

from kakeyaturbo.gpu import fused_norm_encode
from kakeyaturbo.norm_codes import StackedNorms, encoded_with_torch

pytestmark = pytest.mark.skipif(fused_norm_encode.triton is None, reason="Triton is not installed")

# Norms over 30 octaves, float16's largest and smallest, exact zeros, a stream of zeros only,
# blocks of 256, 32, 188 (not a power of two) and 1 token, float32 and float16, contiguous and
# strided: every code where torch puts it (the interpreter's log2 is numpy's), the logs close.
INTERPRETED = textwrap.dedent(
    """
    import torch
    from kakeyaturbo.gpu import fused_norm_encode as F
    from kakeyaturbo.norm_codes import encoded_with_torch

    g = torch.Generator().manual_seed(5)
    checked = 0
    for dtype in (torch.float32, torch.float16):
        for tokens, t in ((256, 768), (32, 320), (188, 376), (1, 5)):
            n = (torch.randn(2, 3, t, generator=g) * 3.0).exp().clamp_max(6e4)
            n[0, 1, 5:40] = 0.0
            n[1, 2] = 0.0
            n[1, 0, :tokens] = 2.0**-24 if dtype == torch.float16 else 1e-9
            n[0, 0, 3] = 65504.0
            n = n.to(dtype)
            for x in (n, n.transpose(0, 1).contiguous().transpose(0, 1)):
                got, want = F.encode(x, tokens), encoded_with_torch(x, tokens)
                assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(got, want))
                assert torch.equal(got[0], want[0]), (dtype, tokens)
                assert F.close(got, want), (dtype, tokens)
                checked += 1
    # Heads' scales: norms over divisors, some under 1e-3, some quotients past float16.
    n = (torch.randn(4, 2, 512, generator=g) * 2.0).exp().clamp_max(6e4)
    n[0, 0, :9] = 0.0
    den = (torch.randn(4, 512, 2, generator=g)).exp().permute(0, 2, 1)  # strided, as a flush's
    den[1, 1, 3:50] = 1e-5
    n[1, 1, 3:9] = 6e4
    for tokens in (256, 64):
        got, want = F.encode(n, tokens, den), encoded_with_torch(n, tokens, den)
        assert torch.equal(got[0], want[0]) and F.close(got, want), tokens
        checked += 1
    print("norm spans checked", checked)
    """
)


def test_the_kernel_codes_the_torch_ops_norms_in_the_interpreter():
    assert "norm spans checked 18" in run_interpreted(INTERPRETED)


# Three layers' values flushed together on the device with token norms, the kernel's check
# passed as on a GPU, coded per head (the default recipe) and across heads (kt-ref-a's joint
# bundle: the kernel divides each head's norm by its decoded unit vector's): each layer's norms
# are the torch ops' to the tolerance, and decode alike.
IN_A_FLUSH = textwrap.dedent(
    """
    import sys, torch
    from kakeyaturbo.gpu import fused_norm_encode as F
    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.modeling import load_model
    from kakeyaturbo.pipeline import Pipeline
    from kakeyaturbo.recipes import default_recipe

    model = load_model(sys.argv[1])[0]
    bundle = Calibration.load(sys.argv[2], model)
    cfg = model.config
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(8)
    calls = []
    real = F.encode

    def counted(norms, tokens, divisor=None):
        calls.append((tuple(norms.shape), divisor is not None))
        return real(norms, tokens, divisor)

    F.encode = counted
    for pipe in (Pipeline(default_recipe()), Pipeline(default_recipe(bundle), bundle)):
        recipe = pipe.recipe
        assert recipe.token_norms("v")
        bs = recipe.block_size
        xs = [torch.randn(2, h, 2 * bs, d, generator=g) * (i + 1) for i in range(3)]
        spans = [(x, i, None, None) for i, x in enumerate(xs)]

        def flush(kernel):
            F.KERNEL.usable = lambda device, check: kernel
            return pipe.fresh().encode_layers_on_device(spans, "v")

        want, got = flush(False), flush(True)
        for a, b in zip(got, want):
            (run_a,), (run_b,) = a.norms.runs, b.norms.runs
            assert F.close(run_a, run_b)
            assert torch.allclose(a.norms.decode(), b.norms.decode(), rtol=1e-4, atol=0)
    # One launch for the three layers each time, across heads dividing by the heads' norms.
    assert calls == [((6, h, 2 * 256), False), ((6, h, 2 * 256), True)], calls
    print("flushes checked", len(calls))
    """
)


def test_a_flush_codes_its_layers_norms_with_the_kernel_in_the_interpreter(model_dir, joint_bundle):
    assert "flushes checked 2" in run_interpreted(IN_A_FLUSH, str(model_dir), str(joint_bundle))


def _coded() -> tuple:
    norms = (torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))).exp()
    norms[0, 0, 7] = 0.0
    return norms, encoded_with_torch(norms, 64)


def test_the_check_refuses_a_code_two_off_a_moved_zero_and_bounds_past_the_tolerance():
    norms, want = _coded()
    codes, low, step = want
    assert fused_norm_encode.close(want, want)
    one_off = codes.clone()
    one_off[1, 2, 0, 5] += 1  # a log2 an ulp away may move a token a code
    assert fused_norm_encode.close((one_off, low, step), want)
    two_off = codes.clone()
    two_off[1, 2, 0, 5] += 2
    assert not fused_norm_encode.close((two_off, low, step), want)
    zero = codes.clone()
    zero[0, 0, 0, 7] = 1  # an exact zero coded as a norm
    assert not fused_norm_encode.close((zero, low, step), want)
    far = fused_norm_encode.TOLERANCE * 4
    assert not fused_norm_encode.close((codes, low + far * low.abs().max(), step), want)
    assert not fused_norm_encode.close((codes, low, step * (1 + far)), want)
    assert not fused_norm_encode.close((codes[..., :-1], low, step), want)


def test_off_a_gpu_the_torch_ops_code_the_norms():
    norms, want = _coded()
    calls = []
    assert not fused_norm_encode.usable(norms, 64, lambda: calls.append("torch"))
    assert calls == []  # the CPU: no check runs, whatever Triton is
    (got,) = StackedNorms.encoded(norms, 64).runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_norm_kernel_that_fails_or_disagrees_is_dropped_with_a_warning():
    norms, want = _coded()

    def agrees(with_kernel) -> bool:
        check = lambda: fused_norm_encode.close(with_kernel(), want)  # noqa: E731
        return fused_norm_encode.KERNEL.agrees(norms.device, check)

    halved = lambda: encoded_with_torch(norms / 2, 64)  # noqa: E731  (every bound a log off)
    right = lambda: encoded_with_torch(norms, 64)  # noqa: E731
    assert_dropped_unless_it_agrees(agrees, "norm encoder", halved, right)
