"""The vLLM hooks on the real reference model in vLLM's layout (tests/support/vllm_layout.py): what
the paged cache holds, what the forward attends to, bytes, removal, and end-to-end quality."""

from __future__ import annotations

import pytest
import torch
from vllm_layout import Engine, LlamaForCausalLM

from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.vllm import VLLMHookConfig, install_hooks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = (600, 520)  # two sequences prefilled in one forward
DECODE = 24  # teacher-forced decode steps, both sequences in each forward


@pytest.fixture(scope="module")
def token_ids(model_dir, eval_text):
    from kakeyaturbo.capture import read_tokens
    from kakeyaturbo.modeling import load_model

    _, tok = load_model(model_dir)
    ids = read_tokens(tok, eval_text, sum(PROMPTS) + 2 * DECODE, offset_chars=20_000)
    a = ids[: PROMPTS[0] + DECODE]
    b = ids[PROMPTS[0] + DECODE :]
    return a, b


@pytest.fixture(scope="module")
def calib_bundle(model_dir, calib_text, tmp_path_factory):
    from kakeyaturbo.calibration import calibrate
    from kakeyaturbo.modeling import load_model

    model, tok = load_model(model_dir)
    calib = calibrate(model, tok, calib_text, tokens=4096, progress=False)
    return calib.save(tmp_path_factory.mktemp("calib"))


@pytest.fixture(scope="module")
def vmodel(model_dir):
    return LlamaForCausalLM(model_dir)


def _run(model, token_ids):
    """Prefill both prompts in one forward, then decode both together, teacher-forced.
    Returns (prefill logits per sequence, decode logits [2, DECODE, V], cache contents
    ``{(seq, layer): (keys, values)}``, copied: the next run reuses the model's cache)."""
    engine = Engine(model)
    a, b = token_ids
    pre = engine.step([(0, a[: PROMPTS[0]]), (1, b[: PROMPTS[1]])])
    dec = []
    for t in range(DECODE):
        out = engine.step([(0, [a[PROMPTS[0] + t]]), (1, [b[PROMPTS[1] + t]])])
        dec.append(torch.cat(out))
    held = {(s, i): engine.cached(s, i) for s in (0, 1) for i in range(len(model.layers))}
    return pre, torch.stack(dec, 1), held


@pytest.fixture(scope="module")
def exact(vmodel, token_ids):
    return _run(vmodel, token_ids)


def _hooked(vmodel, token_ids, config):
    hooks = install_hooks(vmodel, config)
    try:
        return (*_run(vmodel, token_ids), hooks.stats())
    finally:
        hooks.remove()


def _pipeline_roundtrip(rows: torch.Tensor, layer: int, stream: str, config=None):
    """What the shared pipeline makes of one prompt's rows ([tokens, kv_heads, D] or
    [tokens, kv_heads * D]) coded as one sequence with its 4 sinks held exact: (the
    reconstruction as [tokens, kv_heads, D], bytes held: streams, norms and frames)."""
    n = rows.shape[0]
    x = rows.reshape(n, -1, 64).permute(1, 0, 2)[None].float().contiguous()
    pipe = Pipeline((config or VLLMHookConfig()).recipe())
    sinks = torch.zeros((1, n), dtype=torch.bool)
    sinks[:, :4] = True
    y, blocks = pipe.roundtrip(x, layer, stream, sinks=sinks, newer=0)
    nbytes = sum(b.nbytes for b in blocks) + pipe.frame_bytes()
    return y[0].permute(1, 0, 2).to(rows.dtype), nbytes


def _agreement(ref: torch.Tensor, alt: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || alt)) over every decode position."""
    top1 = (ref.argmax(-1) == alt.argmax(-1)).float().mean().item()
    lp, lq = ref.log_softmax(-1), alt.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return top1, kl


def test_layout_reproduces_transformers(model_dir, vmodel, token_ids):
    from kakeyaturbo.modeling import load_model

    hf, _ = load_model(model_dir)
    a = token_ids[0][:200]
    with torch.inference_mode():
        want = hf(torch.tensor([a])).logits[0]
    got = Engine(vmodel).step([(0, a)])[0]
    assert torch.allclose(got, want, atol=2e-3, rtol=0), (got - want).abs().max()


@pytest.fixture(scope="module")
def snapshot(vmodel, token_ids):
    return _hooked(vmodel, token_ids, VLLMHookConfig(mode="snapshot"))


def _pre_rope_keys(vmodel, token_ids) -> list[torch.Tensor]:
    """Sequence 0's exact pre-RoPE keys per layer ([tokens, kv_heads * D]), read off each
    layer's qkv projection in an exact prefill."""
    keys: list[torch.Tensor] = []

    def grab(module, args, out):
        attn = vmodel.layers[len(keys)].self_attn
        keys.append(out[0][:, attn.q_size : attn.q_size + attn.kv_size].clone())

    handles = [layer.self_attn.qkv_proj.register_forward_hook(grab) for layer in vmodel.layers]
    try:
        Engine(vmodel).step([(0, token_ids[0][: PROMPTS[0]])])
    finally:
        for h in handles:
            h.remove()
    return keys


def test_snapshot_prefill_attends_exactly_and_cache_holds_the_codec_output(
    vmodel, token_ids, exact, snapshot
):
    pre, _, held, _ = snapshot
    pre_ref, _, held_ref = exact
    pre_rope = _pre_rope_keys(vmodel, token_ids)
    for got, want in zip(pre, pre_ref):
        assert torch.equal(got, want)  # the prefill forward saw exact K/V
    rot = vmodel.layers[0].self_attn.rotary_emb
    for layer in range(len(vmodel.layers)):
        k, v = held[0, layer]
        k_ref, v_ref = held_ref[0, layer]
        n = PROMPTS[0]
        assert torch.equal(k[:4], k_ref[:4]) and torch.equal(v[:4], v_ref[:4])  # sinks
        if layer == 0:  # decode-step K/V stay exact (deeper ones read the coded prompt)
            assert torch.equal(k[n:], k_ref[n:]) and torch.equal(v[n:], v_ref[n:])
        # The prompt's values are the pipeline's round trip of the exact values, bit for bit
        # (sinks included: the pipeline holds them exact).
        want, _ = _pipeline_roundtrip(v_ref[:n], layer, "v")
        assert torch.equal(v[:n], want)
        # Keys: the round trip of the exact pre-RoPE keys, rotated back.
        k_dec, _ = _pipeline_roundtrip(pre_rope[layer][:n], layer, "k")
        k_dec = k_dec.reshape(n, -1).contiguous()
        k_want = rot(torch.arange(n), k_dec.clone(), k_dec)[1]
        assert torch.allclose(k[:n].reshape(n, -1), k_want, atol=1e-5)
        assert not torch.equal(k[4:n], k_ref[4:n])


def test_snapshot_bytes_are_the_encoded_streams(exact, snapshot):
    _, _, _, stats = snapshot
    _, _, held_ref = exact
    want = 0
    for layer in range(6):
        for seq, n in enumerate(PROMPTS):
            _, v_ref = held_ref[seq, layer]
            want += _pipeline_roundtrip(v_ref[:n], layer, "v")[1]
    got = sum(r["encoded_bytes"] for r in stats["layers"] if r["stream"] == "v")
    assert got == want
    coded = sum(n - 4 for n in PROMPTS)
    for r in stats["layers"]:
        assert r["coded_tokens"] == coded
        assert r["exact_tokens"] == 4 * 2 + DECODE * 2
        assert r["bf16_bytes"] == coded * 2 * 64 * 2
    assert stats["forwards"] == 1 + DECODE and stats["coded_forwards"] == 1
    assert stats["d2h_bytes"] == 0  # CPU tensors cross by DLPack, no copy is counted
    # 900-token prompts: each carries its own float16 frames (the self-calibrated recipe).
    assert stats["ratio_vs_bf16"] > 2.8


def test_snapshot_decode_quality(exact, snapshot):
    _, dec, _, _ = snapshot
    top1, kl = _agreement(exact[1], dec)
    assert not torch.equal(dec, exact[1])
    assert top1 >= 0.85 and kl < 0.05, (top1, kl)


def test_in_forward_prefill_sees_the_reconstruction(vmodel, token_ids, exact):
    pre, dec, held, stats = _hooked(vmodel, token_ids, VLLMHookConfig(mode="in-forward"))
    assert not torch.equal(pre[0], exact[0][0])  # the prefill itself attended to the codec
    top1, kl = _agreement(exact[1], dec)
    assert top1 >= 0.8 and kl < 0.1, (top1, kl)
    assert stats["coded_forwards"] == 1
    # The prefill attention ran once per layer per forward (no second write in this mode).
    assert all(layer.self_attn.attn.calls > 0 for layer in vmodel.layers)


def test_post_rope_hook_codes_rotated_keys(vmodel, token_ids, exact):
    _, dec, held, stats = _hooked(
        vmodel, token_ids, VLLMHookConfig(mode="snapshot", hook="post-rope", streams="k")
    )
    k, v = held[1, 2]
    k_ref, v_ref = exact[2][1, 2]
    n = PROMPTS[1]
    assert torch.equal(v[:n], v_ref[:n])  # streams="k": the prompt's values untouched
    # Post-RoPE keys are coded as attention receives them: no unrotation.
    want, _ = _pipeline_roundtrip(k_ref[:n], 2, "k")
    assert torch.equal(k[:n], want)
    assert all(r["stream"] == "k" or r["coded_tokens"] == 0 for r in stats["layers"])
    top1, _ = _agreement(exact[1], dec)
    assert top1 >= 0.8


def test_skip_layers_stay_exact(vmodel, token_ids, exact):
    _, _, held, stats = _hooked(vmodel, token_ids, VLLMHookConfig(skip_layers=(0, 5)))
    n = PROMPTS[0]  # snapshot: the prompt's K/V of skipped layers are exact
    for layer in (0, 5):
        for got, want in zip(held[0, layer], exact[2][0, layer]):
            assert torch.equal(got[:n], want[:n])
    assert not torch.equal(held[0, 1][1], exact[2][0, 1][1])
    assert {r["layer"] for r in stats["layers"] if r["coded_tokens"]} == {1, 2, 3, 4}


def test_remove_restores_the_exact_model(vmodel, token_ids, exact):
    rotary = vmodel.layers[3].self_attn.rotary_emb
    hooks = install_hooks(vmodel, VLLMHookConfig(mode="in-forward"))
    assert vmodel.layers[3].self_attn.rotary_emb is not rotary
    hooks.remove()
    assert vmodel.layers[3].self_attn.rotary_emb is rotary
    pre, dec, _ = _run(vmodel, token_ids)
    assert torch.equal(dec, exact[1]) and torch.equal(pre[1], exact[0][1])


def test_calibrated_keys(vmodel, token_ids, exact, calib_bundle):
    _, dec, _, stats = _hooked(
        vmodel, token_ids, VLLMHookConfig(mode="snapshot", calibration=str(calib_bundle))
    )
    top1, kl = _agreement(exact[1], dec)
    assert top1 >= 0.85 and kl < 0.05, (top1, kl)
    assert stats["config"]["calibration"] == str(calib_bundle)
    assert stats["ratio_vs_bf16"] > 4.5


def test_unsupported_models_are_refused(vmodel):
    class NoPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = vmodel

        def forward(self, input_ids):
            return input_ids

    with pytest.raises(NotImplementedError, match="positions"):
        install_hooks(NoPositions(), VLLMHookConfig(hook="post-rope"))
    with pytest.raises(NotImplementedError, match="no vLLM decoder Attention"):
        install_hooks(torch.nn.Linear(2, 2))
    # pre-RoPE needs a known attention family around the Attention layer
    renamed = type("FancyAttention", (torch.nn.Module,), {})
    layer = vmodel.layers[0].self_attn
    original = layer.__class__
    layer.__class__ = type("FancyAttention", (renamed,), dict(original.__dict__))
    try:
        with pytest.raises(NotImplementedError, match="post-rope"):
            install_hooks(vmodel, VLLMHookConfig(hook="pre-rope"))
    finally:
        layer.__class__ = original
    assert vmodel.layers[1].self_attn.rotary_emb is vmodel.layers[0].self_attn.rotary_emb
