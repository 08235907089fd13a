"""The Triton kernels for a decode step's softmax and value sums over blocks coded across heads
(``fused_joint_attend.py``), which replace about twenty torch ops per layer on a GPU: they must
give their torch twin's output to float32 rounding whatever the exact runs hold (the sinks'
transposed layout, int8 rows, bfloat16, runs of no tokens), with and without token scales,
masks (a row masked whole gets zeros), a softcap, several query tokens and spans; inside a
real model's decode steps too, beside the key logits' kernel; and a failing kernel must leave
the torch twin in charge. Run
here in Triton's interpreter on the CPU (fresh processes); tests/gpu/test_cuda.py runs the
compiled kernels where a GPU is present."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import assert_twin_checked  # tests/support (pythonpath)
from triton_interpreter import run_interpreted  # tests/support (pythonpath)

from kakeyaturbo.gpu import fused_joint_attend as fj
from kakeyaturbo.hf import int8_rows

pytestmark = pytest.mark.skipif(fj.triton is None, reason="Triton is not installed")


def inputs(seed, b, h, d, g, tq, t, runs, int8=True, scales=True, bias=0, dtype=torch.float32):
    """Random attention inputs: ``runs`` exact tokens per run (the first held as sinks are, a
    transposed bfloat16 view; the second's values as int8 rows with ``int8``); token
    ``scales`` as float32 (True), as their one-byte codes by blocks ("codes") or none;
    ``bias`` 0: none, 1: one row for all (an expanded view), 2: per batch and query row, one
    row masked whole (random, some coded and exact columns masked)."""
    gen = torch.Generator().manual_seed(seed)
    rows, c = g * tq, h * d

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def token_scales():
        if scales != "codes":
            return torch.rand(b, h, t, generator=gen) + 0.5 if scales else None
        tokens = max(n for n in range(1, 257) if t % n == 0)  # blocks of equal tokens
        codes = torch.randint(0, 256, (b, h, t // tokens, tokens), generator=gen)
        low, step = rand(b, h, t // tokens), torch.rand(b, h, t // tokens, generator=gen) / 64
        return fj.ScaleCodes(codes.to(torch.uint8), low, step)  # code 0 (a zero) included

    coded = fj.Coded(
        rand(b, h * rows, t) * 3.0,
        token_scales(),
        rand(b, t, c),
        token_scales(),
        rand(h, c, d) / c**0.5,
    )
    keys, values = [], []
    for i, n in enumerate(runs):
        if i == 0:
            keys.append(rand(b, n, h, d).to(torch.bfloat16).transpose(1, 2))
            values.append(rand(b, n, h, d).to(torch.bfloat16).transpose(1, 2))
        else:
            keys.append(rand(b, h, n, d).to(dtype))
            v = rand(b, h, n, d)
            values.append(int8_rows.encode_torch(v) if int8 and i == 1 else v.to(dtype))
    mask = None
    if bias:
        mask = rand(b if bias == 2 else 1, 1, h * rows if bias == 2 else 1, t + sum(runs))
        mask[..., : t // 3] = float("-inf")
        mask[..., t + 1 :: 3] = float("-inf")  # exact columns too: each run's offset counts
        if bias == 2:
            mask[-1, :, 1] = float("-inf")
        else:  # one row for every query row: an expanded view, as layers share it
            mask = mask.expand(-1, -1, h * rows, -1)
    return coded, rand(b, h, rows, d).to(dtype), keys, values, mask


# (seed, batch rows, KV heads, head dim, query heads per KV head, query tokens, coded tokens,
# exact runs, int8 values, scales, bias, softcap, dtype): SmolLM2's decode step (3 x 64, 3
# query heads each) over many spans; two query tokens with a masked row and a softcap; one
# head of an odd width and a token; the most query rows in bfloat16; no sinks; SmolLM2's step
# with a masked row and a softcap. Scales as codes: the kernels decode them as they load them.
LAYOUTS = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from kakeyaturbo.gpu import fused_joint_attend as fj
    from test_fused_joint_attend import inputs
    layouts = [
        (0, 1, 3, 64, 3, 1, 3000, (4, 50, 1), True, True, 0, None, torch.float32),
        (1, 2, 2, 32, 2, 2, 300, (4, 20, 2), False, False, 2, 30.0, torch.float32),
        (2, 1, 1, 20, 1, 1, 5, (3, 0, 1), True, "codes", 1, None, torch.float32),
        (3, 1, 4, 48, 4, 4, 1300, (2, 33, 4), True, False, 0, None, torch.bfloat16),
        (4, 2, 3, 64, 3, 1, 600, (0, 64, 1), True, "codes", 1, None, torch.float32),
        (5, 1, 3, 64, 3, 1, 1024, (4, 40, 1), True, "codes", 2, 50.0, torch.float32),
    ]
    for *layout, softcap, dtype in layouts:
        seed, b, h, d, g, tq, t, runs, int8, scales, bias = layout
        coded, q, keys, values, mask = inputs(*layout, dtype)
        args = (coded, q, keys, values, mask, 0.125, softcap, tq)
        got = fj.attend(*args, torch.float32)
        want = fj.attend_with_torch(*args, torch.float32)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert got.shape == (b, tq, h * g, d) and err < 1e-5, (seed, err)
        assert fj.close(*args, dtype)
        assert torch.equal(fj.attend(*args, dtype), got.to(dtype))  # the output's dtype
        if bias == 2:  # the row masked whole: zeros, as the torch path's nan_to_num gives
            assert not got[-1, 1 % tq, 1 // tq].any()
    print("layouts checked", len(layouts))
    """
)

# kt-ref-a with a bundle coded across heads and key norms, sinks in blocks, int8 hot values
# and a padded row: the torch path of attention over the codes (what a GPU runs) with the key
# logits' kernel (fused_attention.py) and both of these serving the decode steps, against the
# same path with none.
IN_A_MODEL = textwrap.dedent(
    """
    import sys, torch
    from kakeyaturbo.gpu import fused_attention as fa, fused_joint_attend as fj
    from kakeyaturbo.calibration import Calibration
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache, coded_attention
    from kakeyaturbo.modeling import load_model
    from kakeyaturbo.recipes import default_recipe

    torch.set_num_threads(1)
    coded_attention.CPU_KERNELS = False
    model = load_model(sys.argv[1])[0]
    bundle = Calibration.load(sys.argv[2], model)
    recipe = default_recipe(bundle, block_size=64).replace(k_token_norms=True)
    assert recipe.sink_tokens > 0
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 420), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    ran, scored = [], []
    real, real_logits = fj.attend, fa.joint_key_logits

    def counted(*args):
        ran.append(len(args[2]))  # the exact runs read
        return real(*args)

    def counted_logits(*args):
        scored.append(args[3].shape)
        return real_logits(*args)

    def logits(kernel):
        # The kernels' device checks passed (or failed) as on a GPU; their own limits hold.
        fa.KERNEL.usable = fj.KERNEL.usable = lambda device, check: kernel
        fj.attend, fa.joint_key_logits = counted, counted_logits
        kw = {"calibration": bundle, "recipe": recipe, "residual_length": 64}
        cache = KakeyaCache.from_model(model, **kw)
        assert cache.int8_hot_values
        arg = {CACHE_ARG: cache}
        out = []
        with torch.inference_mode():
            out.append(model(ids[:, :400], attention_mask=mask[:, :400], **arg).logits)
            for t in range(400, 404):
                out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **arg).logits)
        return out

    without = logits(False)
    assert not ran and not scored
    with_kernels = logits(True)
    layers = model.config.num_hidden_layers
    assert ran == [3] * (4 * layers), ran  # every decode step's layers: sinks, window, new
    assert len(scored) == 4 * layers, len(scored)
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(with_kernels, without))
    assert worst < 1e-5, worst
    print("decode steps checked", len(ran), "worst", worst)
    """
)


def test_the_kernels_give_the_torch_output_in_every_layout_in_the_interpreter():
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    assert "layouts checked 6" in run_interpreted(LAYOUTS, here)


def test_a_models_decode_steps_attend_with_the_kernels_as_with_torch(model_dir, joint_bundle):
    assert "decode steps checked" in run_interpreted(IN_A_MODEL, str(model_dir), str(joint_bundle))


def test_the_torch_twin_is_attention_over_the_joined_tokens():
    """The twin against attention written out plainly: every token's key and value (the
    coded ones through the frame and their scales), one softmax, ``nan_to_num``."""
    coded, q, keys, values, mask = inputs(5, 2, 2, 16, 3, 1, 40, (2, 7, 1), bias=2)
    got = fj.attend_with_torch(coded, q, keys, values, mask, 0.3, None, 1, torch.float32)
    b, h, rows, d = q.shape
    k = torch.cat([x.float() for x in keys], dim=-2)
    v = torch.cat([int8_rows.decode(x) if x.dtype is torch.int8 else x.float() for x in values], -2)
    want = torch.zeros(b, 1, h * rows, d)
    for bi in range(b):
        for hi in range(h):
            coded_v = coded.values[bi] @ coded.frames[hi] * coded.value_scales[bi, hi, :, None]
            for r in range(rows):
                row = hi * rows + r
                logits = coded.logits[bi, row] * coded.key_scales[bi, hi]
                scores = torch.cat((logits, k[bi, hi] @ q[bi, hi, r])) * 0.3 + mask[bi, 0, row]
                p = torch.softmax(scores, 0).nan_to_num(0.0)
                want[bi, 0, row] = p[:40] @ coded_v + p[40:] @ v[bi, hi]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not got[1, 0, 1].any()  # the row masked whole


def test_off_a_gpu_the_torch_twin_attends_and_a_failing_kernel_is_dropped(monkeypatch):
    args = (*inputs(6, 1, 2, 16, 2, 1, 30, (2, 5, 1)), 0.25, None, 1, torch.float32)
    assert not fj.usable(*args)  # the CPU, whatever Triton is
    many = inputs(6, 1, 2, 16, 2, 1, 30, (2, 5, 1, 1))
    assert not fj.usable(*many, 0.25, None, 1, torch.float32)  # more runs than it reads
    check = lambda: fj.close(*args)  # noqa: E731
    device = args[1].device
    assert_twin_checked(monkeypatch, fj, "attend", fj.KERNEL, device, check, fj.attend_with_torch)
