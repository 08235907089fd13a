"""The Triton encoder of coded blocks (``fused_encode.py``), which codes a span on a GPU in
place of the torch encoder's ops: it must give the codec's blocks byte for byte, as the torch
encoder does, and a failing kernel must leave the torch encoder in charge. Run here in
Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set before Triton is imported: a
fresh process); tests/gpu/test_cuda.py runs the compiled kernels where a GPU is present."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from kernel_checks import assert_dropped_unless_it_agrees  # tests/support (pythonpath)
from triton_interpreter import run_interpreted  # tests/support (pythonpath)

from kakeyaturbo.gpu import fused_encode
from kakeyaturbo.gpu.device_encode import encode_run
from kakeyaturbo.recipes import default_recipe

pytestmark = pytest.mark.skipif(fused_encode.triton is None, reason="Triton is not installed")

# Against the codec's own blocks: every width from 0 to 8, a rate below one bit per component,
# the three skeleton dtypes, both metrics, many outliers and none (test_device_encode's
# streams: a constant component, equal ones, zeros on the middle bound, heavy tails); widths
# past one program's components (192, 300) and vector counts that are not whole tiles; a
# stream with fewer positive gains than bits to give; several layers' rates in one call; and
# a scale whose float16 rounding through float32 differs from rounding once.
INTERPRETED = textwrap.dedent(
    """
    import sys
    import torch
    import kakeyaturbo as kt
    from kakeyaturbo.gpu.device_decode import PackedRun
    from kakeyaturbo.gpu.device_encode import encode_runs_with_kernels
    from kakeyaturbo.gpu.fused_encode import same_run, same_runs
    from kakeyaturbo.recipes import default_recipe

    sys.path.insert(0, sys.argv[1])  # tests/
    from test_device_encode import _streams

    cpu = torch.device("cpu")
    checked = 0

    def check(x, params, want=None):
        global checked
        if want is None:
            want = kt.encode_batch(x, params)
        got = encode_runs_with_kernels(x, params)[0]
        assert same_run(got, PackedRun.of(want, cpu)), (tuple(x.shape), params)
        checked += 1
        return got

    changes = [
        {}, {"bits_per_value": 1.25}, {"bits_per_value": 7.5}, {"bits_per_value": 0.3},
        {"skeleton_dtype": "bf16"}, {"skeleton_dtype": "fp32", "metric": "inner_product"},
        {"outlier_threshold": 1.5}, {"outlier_threshold": float("inf")},
    ]
    x = _streams(1)
    for change in changes:
        check(x, default_recipe().k.replace(block_size=256, **change))
    g = torch.Generator().manual_seed(2)
    for shape in [(1, 1, 5), (3, 7, 3), (2, 300, 192), (1, 16, 300), (2, 33, 1)]:
        x = torch.randn(*shape, generator=g) * torch.linspace(0.1, 5.0, shape[-1])
        x[0, 0, 0] = 40.0
        params = default_recipe().v.replace(block_size=shape[1], outlier_threshold=2.0)
        assert check(x, params).outlier_pos.numel() > 0 or shape[1] == 1
    few = torch.zeros(2, 40, 16)
    few[:, :, 3] = torch.randn(2, 40, generator=g)
    run = check(few, default_recipe().k.replace(block_size=40, bits_per_value=4.0))
    assert run.per_vector.tolist() == [8, 8]
    x = _streams(4, k=4)
    base = default_recipe().k.replace(block_size=256)
    rates = [base.replace(bits_per_value=r) for r in (2.5, 1.75, 4.0, 2.5)]
    check(x, rates, [kt.encode_batch(x[i : i + 1], p)[0] for i, p in enumerate(rates)])
    one = [1.6767759323120117, -0.6035685539245605, 2.820655107498169, -0.519212007522583]
    one = torch.tensor(one)[None, :, None]
    assert check(one, base.replace(block_size=4)).sigma.item() == 1.462890625
    # Several layers' spans in one call, each part laid out as PackedRun.split lays it out
    # (views of the call's tensors), at the parts' own rates, outliers in most stream-blocks.
    x = _streams(6, k=6)
    rates = [base.replace(bits_per_value=r, outlier_threshold=2.5) for r in (2.5, 1.75, 4.0)]
    per = [rates[0], rates[1], rates[1], rates[1], rates[2], rates[2]]
    encs = [kt.encode_batch(x[i : i + 1], p)[0] for i, p in enumerate(per)]
    for parts in ([1, 3, 2], [6], [2, 2, 2], [5, 1]):
        got = encode_runs_with_kernels(x, per, parts)
        assert same_runs(got, PackedRun.of(encs, cpu).split(parts)), parts
        assert [r.outlier_pos.numel() > 0 for r in got] == [True] * len(parts)
        checked += 1
    # Refused as the codec refuses it, though the kernels have run on it.
    bad = _streams(5, k=2)
    refused = [(float("nan"), "non-finite value at vector 3, dim 4")]
    refused.append((-1e6, "magnitude -1e+06 at vector 3, dim 4"))
    for value, message in refused:
        bad[1, 3, 4] = value
        try:
            encode_runs_with_kernels(bad, base)
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"{value} was coded")
    print("spans checked", checked)
    """
)


def test_the_kernels_code_the_codecs_blocks_byte_for_byte_in_the_interpreter():
    here = os.path.dirname(os.path.abspath(__file__))
    assert "spans checked 20" in run_interpreted(INTERPRETED, here)


# kt-ref-a with a bundle coded across heads, a padded row and sinks, flushing its prompt's
# layers together and then its decode steps' blocks: every layer holds the same runs coded by
# the kernels as by the torch encoder, and the logits are the same bits.
IN_A_MODEL = textwrap.dedent(
    """
    import sys, torch
    from kakeyaturbo.gpu import fused_encode
    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, coded_attention
    from kakeyaturbo.modeling import load_model
    from kakeyaturbo.recipes import default_recipe

    torch.set_num_threads(1)
    coded_attention.CPU_KERNELS = False  # blocks coded and held where the model runs
    model = load_model(sys.argv[1])[0]
    bundle = Calibration.load(sys.argv[2], model)
    recipe = default_recipe(bundle, block_size=64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 330), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    calls = []
    real = fused_encode.encode

    def counted(*args):
        calls.append(len(args[-1]))  # the layers coded in the call
        return real(*args)

    fused_encode.encode = counted

    def run(kernels):
        # The kernels' device check passed (or failed) as on a GPU.
        fused_encode.KERNEL.usable = lambda device, check: kernels
        kw = {"calibration": bundle, "recipe": recipe, "residual_length": 64}
        arg = {CACHE_ARG: KakeyaCache.from_model(model, **kw)}
        with torch.inference_mode():
            out = [model(ids[:, :260], attention_mask=mask[:, :260], **arg).logits]
            for t in range(260, 330):
                out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **arg).logits)
        runs = lambda layer: [r for s in ("k", "v") for r, _ in layer._on_device[s].runs]
        return out, [runs(layer) for layer in arg[CACHE_ARG].layers]

    (want, want_held), (got, got_held) = run(False), run(True)
    assert len(calls) > 2 and max(calls) > 1, calls  # the prompt's layers together, then steps'
    for a, b in zip(got_held, want_held):
        assert fused_encode.same_runs(a, b)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    print("layers checked", len(got_held), "calls", len(calls))
    """
)


def test_a_models_blocks_are_coded_by_the_kernels_as_by_torch_in_the_interpreter(
    model_dir, joint_bundle
):
    out = run_interpreted(IN_A_MODEL, str(model_dir), str(joint_bundle))
    assert "layers checked" in out, out


def _span() -> tuple[torch.Tensor, object]:
    x = torch.randn(3, 64, 48, generator=torch.Generator().manual_seed(7))
    return x, default_recipe().k.replace(block_size=64)


def test_off_a_gpu_the_torch_ops_encode():
    x, params = _span()
    calls = []
    check = lambda y: calls.append("range")  # noqa: E731
    assert not fused_encode.usable(x, lambda: calls.append("t"), lambda: calls.append("k"), check)
    assert calls == []  # the CPU: no check runs, whatever Triton is
    assert encode_run(x, params).codes.device.type == "cpu"


def test_a_kernel_that_fails_or_disagrees_is_dropped_with_a_warning():
    from kakeyaturbo.gpu import device_encode

    x, params = _span()
    want = encode_run(x, params)

    def agrees(with_kernels) -> bool:
        check = lambda: fused_encode.same_run(with_kernels(), want)  # noqa: E731
        return fused_encode.KERNEL.agrees(x.device, check)

    other = lambda: encode_run(x, params.replace(bits_per_value=params.bits_per_value + 1))  # noqa: E731
    assert_dropped_unless_it_agrees(agrees, "encoder", other, lambda: encode_run(x, params))
    shifted = device_encode.encode_run(x, params)
    shifted.outlier_tiles = shifted.outlier_tiles + 1  # one field off is enough
    with pytest.warns(RuntimeWarning, match="encoder disagrees"):
        assert not agrees(lambda: shifted)
