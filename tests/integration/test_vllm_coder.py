"""The vLLM hooks' tensor path on real K/V, in vLLM's row layout, with real torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeyaturbo._arrays import from_core, to_core
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.vllm import KVCoder, VLLMHookConfig
from kakeyaturbo.vllm.coder import plan_forward, runs_from_positions, runs_from_query_starts
from kakeyaturbo.vllm.transfer import TransferStats, to_device


def test_runs_split_where_positions_do_not_continue():
    pos = [*range(100), *range(10), 57, 3, *range(64)]
    assert runs_from_positions(pos) == [(0, 100), (100, 110), (110, 111), (111, 112), (112, 176)]
    assert runs_from_positions([]) == []
    assert runs_from_query_starts([0, 100, 110, 110, 111]) == [(0, 100), (100, 110), (110, 111)]
    with pytest.raises(ValueError, match="query_start_loc"):
        runs_from_query_starts([1, 5])


def test_plan_keeps_sinks_and_short_runs_exact():
    cfg = VLLMHookConfig(sink_tokens=4, min_tokens=16)
    pos = [*range(100), *range(10), 57, *range(2, 40), *range(300, 316)]
    plan = plan_forward(torch.tensor(pos), cfg)
    # run 1: coded with its sinks 0..3 held exact; run 2: 10 tokens < 16; decode step; run 4:
    # positions 2, 3 are sinks; run 5: a later chunk of a long prompt (no sinks), exactly
    # min_tokens long.
    assert plan.coded == ((0, 100), (111, 149), (149, 165))
    assert plan.sinks == (4, 2, 0)
    assert plan.num_tokens == len(pos) and plan.coded_tokens == 100 + 38 + 16
    # A run is coded only if it has min_tokens rows past its sinks.
    short = plan_forward(torch.tensor([*range(19), *range(2, 20)]), cfg)
    assert short.coded == ((19, 37),) and short.sinks == (2,)
    with pytest.raises(ValueError, match="outside"):
        plan_forward(np.arange(10), cfg, runs=[(0, 11)])


def _vllm_rows(real_kv, layer, stream):
    """Two sequences stacked as vLLM stacks them: [tokens, kv_heads * head_dim]."""
    name = f"layer{layer}.k_pre_rope" if stream == "k" else f"layer{layer}.{stream}"
    x = torch.from_numpy(real_kv[name])  # [H, 1024, D]
    a, b = x[:, :600], x[:, 600:1000]
    rows = torch.cat([a.permute(1, 0, 2), b.permute(1, 0, 2)]).reshape(1000, -1)
    positions = torch.cat([torch.arange(600), torch.arange(400)])
    return rows.contiguous(), positions


@pytest.mark.parametrize("stream", ["k", "v"])
def test_roundtrip_codes_each_sequence_like_the_pipeline(real_kv, stream):
    cfg = VLLMHookConfig()
    coder = KVCoder(cfg)
    rows, positions = _vllm_rows(real_kv, 3, stream)
    plan = plan_forward(positions, cfg)
    assert plan.coded == ((0, 600), (600, 1000)) and plan.sinks == (4, 4)
    out = coder.roundtrip(rows, 3, stream, plan, head_dim=64)
    assert out.shape == rows.shape and out.dtype == rows.dtype
    assert torch.equal(out[:4], rows[:4]) and torch.equal(out[600:604], rows[600:604])
    # Each sequence is an independent stream through the shared pipeline (its own frames) and
    # gives exactly what the evaluation's `kakeya` method gives for that prefix.
    method = build_method("kakeya")
    nbytes = 0
    for s, e in plan.coded:
        x = rows[s:e].view(e - s, 2, 64).permute(1, 0, 2)[None].contiguous()
        pipe = Pipeline(cfg.recipe(), None)
        sinks = torch.zeros((1, e - s), dtype=torch.bool)
        sinks[:, :4] = True
        want, blocks = pipe.roundtrip(x, 3, stream, sinks=sinks, newer=0)
        nbytes += sum(b.nbytes for b in blocks) + pipe.frame_bytes()
        got = out[s:e].view(e - s, 2, 64).permute(1, 0, 2)[None]
        assert torch.equal(got, want)
        ev, _ = method.compress(x, 3, stream)
        assert torch.equal(got, ev)
    rel = (out - rows).norm() / rows.norm()
    assert 0 < rel < 0.5
    count = coder.stats.as_dict()
    assert count["encoded_bytes"] == nbytes
    assert count["coded_tokens"] == 992 and count["exact_tokens"] == 8
    assert count["bf16_bytes"] == 992 * 128 * 2


def test_roundtrip_keeps_dtype_and_skips_what_it_should(real_kv):
    rows, positions = _vllm_rows(real_kv, 1, "v")
    cfg = VLLMHookConfig(skip_layers=(1,), streams="v")
    coder = KVCoder(cfg)
    plan = plan_forward(positions, cfg)
    assert coder.roundtrip(rows, 1, "v", plan, 64) is rows  # skipped layer
    assert coder.roundtrip(rows, 2, "k", plan, 64) is rows  # stream not coded
    bf = rows.to(torch.bfloat16).view(1000, 2, 64)  # the 3-D view vLLM's Attention makes
    out = coder.roundtrip(bf, 2, "v", plan, 64)
    assert out.dtype == torch.bfloat16 and out.shape == bf.shape
    assert torch.equal(out[:4], bf[:4])
    assert not torch.equal(out[4:600], bf[4:600])


def test_roundtrip_rejects_bad_input(real_kv):
    rows, positions = _vllm_rows(real_kv, 1, "v")
    cfg = VLLMHookConfig()
    coder = KVCoder(cfg)
    plan = plan_forward(positions, cfg)
    with pytest.raises(ValueError, match="999 rows"):
        coder.roundtrip(rows[:999], 1, "v", plan, 64)
    with pytest.raises(TypeError, match="dtype"):
        coder.roundtrip(rows.to(torch.int32), 1, "v", plan, 64)
    with pytest.raises(ValueError, match="not \\[tokens, kv_heads \\* 48\\]"):
        coder.roundtrip(rows, 1, "v", plan, 48)
    bad = rows.clone()
    bad[100, 3] = float("nan")
    with pytest.raises(ValueError, match="layer 1 v: .*(NaN|finite)"):
        coder.roundtrip(bad, 1, "v", plan, 64)
    with pytest.raises(TypeError, match="torch.Tensor"):
        coder.roundtrip(rows.numpy(), 1, "v", plan, 64)


def test_dlpack_crossing_is_zero_copy_on_cpu():
    # The coder hands float32 CPU tensors to kt.encode_batch and asks kt.decode_batch for torch.
    t = torch.randn(4, 32, 64)
    a, _, _ = to_core(t, "x", 3)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    back = from_core(a, "float32", None, "torch")
    assert back.data_ptr() == t.data_ptr()
    stats = TransferStats()
    assert to_device(t, torch.device("cpu"), stats) is t and stats.h2d_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_take_a_measured_host_round_trip(real_kv):
    rows, positions = _vllm_rows(real_kv, 2, "v")
    cfg = VLLMHookConfig()
    coder = KVCoder(cfg)
    cpu = coder.roundtrip(rows, 2, "v", plan_forward(positions, cfg), 64)
    gpu = coder.roundtrip(rows.cuda(), 2, "v", plan_forward(positions.cuda(), cfg), 64)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    s = coder.stats.as_dict()
    assert s["d2h_bytes"] == rows.numel() * 4 and s["h2d_bytes"] == rows.numel() * 4
    assert s["d2h_seconds"] > 0 and s["h2d_seconds"] > 0
