"""The Triton kernel for the logits of keys coded across heads (``fused_attention.py``), which
scores on a GPU in place of about ten torch ops per layer: it must give the torch ops' logits
to float32 rounding, in every layout attention hands it (partial rotary, per-row positions,
tiles cut short, pairs wider than one tile), inside a real model's decode steps too
(``tests/gpu/test_fused_joint_attend.py`` runs kt-ref-a's with it and the attention kernels), and
a failing kernel must leave the torch ops in charge. Run here in Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``, set before Triton is imported: fresh processes);
tests/gpu/test_cuda.py runs the compiled kernel where a GPU is present."""

from __future__ import annotations

import textwrap

import pytest
import torch
from kernel_checks import assert_twin_checked  # tests/support (pythonpath)
from triton_interpreter import run_interpreted  # tests/support (pythonpath)

from kakeyaturbo.gpu import fused_attention
from kakeyaturbo.gpu.fused_attention import TOLERANCE
from kakeyaturbo.gpu.triton_support import within_tolerance

pytestmark = pytest.mark.skipif(fused_attention.triton is None, reason="Triton is not installed")

# (batch rows, KV heads, head dim, rotated channels per head, query rows per head, tokens,
# position rows): SmolLM2's joint keys (3 heads x 64, 3 query heads each), a partial rotary,
# per-row positions, one token, the most query rows, pairs over two tiles (2 heads x 128),
# sizes under every tile's; columns in a shuffled order (adjacent-pair RoPE's) or as they are.
LAYOUTS = textwrap.dedent(
    """
    import torch
    from kakeyaturbo.gpu import fused_attention as fa
    g = torch.Generator().manual_seed(0)
    layouts = [
        (1, 3, 64, 64, 3, 700, 1), (2, 2, 32, 16, 2, 100, 2), (1, 3, 64, 64, 3, 1, 1),
        (1, 2, 128, 128, 32, 33, 1), (2, 4, 12, 4, 1, 40, 1), (1, 1, 20, 8, 1, 70, 1),
    ]
    for b, h, d, rot, rows, t, bp in layouts:
        c, p = h * d, h * rot // 2
        y = torch.randn(b, t, c, generator=g) * torch.linspace(0.1, 3.0, c)
        frame = torch.randn(c, c, generator=g) / c**0.5
        angles = torch.rand(bp, t, p, generator=g) * 100.0
        rotation = torch.stack((angles.cos(), angles.sin()), dim=2)
        q = torch.randn(b, h, rows, d, generator=g)
        for order in (torch.randperm(c, generator=g), torch.arange(c)):
            got = fa.joint_key_logits(y, frame, rotation, q, order)
            want = fa.joint_key_logits_with_torch(y, frame, rotation, q, order)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert got.shape == (b, h * rows, t) and err < 1e-5, (b, h, d, rot, rows, t, bp, err)
            assert fa.close(y, frame, rotation, q, order)
    print("layouts checked", len(layouts))
    """
)


def test_the_kernel_gives_the_torch_logits_in_every_layout_in_the_interpreter():
    assert "layouts checked 6" in run_interpreted(LAYOUTS)


def _inputs(seed: int, t: int, h: int = 3, d: int = 64, rows: int = 3):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(1, t, h * d, generator=g)
    frame = torch.randn(h * d, h * d, generator=g) / (h * d) ** 0.5
    angles = torch.rand(1, t, h * d // 2, generator=g) * 50.0
    rotation = torch.stack((angles.cos(), angles.sin()), dim=2)
    return y, frame, rotation, torch.randn(1, h, rows, d, generator=g), torch.randperm(h * d)


def test_the_tolerance_tells_float32_from_tf32_products():
    """The first call's check passes float32 sums in another order and fails products rounded
    to TF32's 10-bit mantissa (what a kernel left at Triton's default precision would give)."""
    y, frame, rotation, q, order = _inputs(1, 300)
    want = fused_attention.joint_key_logits_with_torch(y, frame, rotation, q, order)
    # The same sums in float64, rounded to float32: another order of float32 sums is closer.
    exact = fused_attention.joint_key_logits_with_torch(
        y.double(), frame.double(), rotation.double(), q.double(), order
    ).float()
    assert within_tolerance(exact, want, TOLERANCE)

    def tf32(x: torch.Tensor) -> torch.Tensor:
        return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)  # 10 mantissa bits kept

    rounded = fused_attention.joint_key_logits_with_torch(tf32(y), tf32(frame), rotation, q, order)
    assert not within_tolerance(rounded, want, TOLERANCE)
    assert not within_tolerance(want[..., 1:], want, TOLERANCE)  # shapes must match
    assert not within_tolerance(want * float("nan"), want, TOLERANCE)


def test_the_wide_queries_read_each_head_on_its_own_channels():
    q = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4) + 1.0
    wide = fused_attention.wide_queries(q)
    assert wide.shape == (2, 6, 12)
    for h in range(3):
        for i in range(2):
            row = wide[:, h * 2 + i]
            assert torch.equal(row[:, h * 4 : h * 4 + 4], q[:, h, i])
            assert row.count_nonzero() == 2 * 4  # zero in the other heads' channels
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fused_attention.wide_queries(q, order), wide[..., order])


def test_off_a_gpu_the_torch_ops_score_and_a_failing_kernel_is_dropped(monkeypatch):
    args = _inputs(2, 40, h=1, rows=4)
    assert not fused_attention.usable(*args)  # the CPU, whatever Triton is
    check = lambda: fused_attention.close(*args)  # noqa: E731
    twin = fused_attention.joint_key_logits_with_torch
    kernel, device = fused_attention.KERNEL, args[0].device
    assert_twin_checked(
        monkeypatch, fused_attention, "joint_key_logits", kernel, device, check, twin
    )
