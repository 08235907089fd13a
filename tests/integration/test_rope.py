"""Inverse RoPE is exact in both pairings, and matches the model's own rotation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from kakeyaturbo.hf.rope import rotary_spec_from_config


def _reference_adjacent(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor):
    """GPT-J's rotate_every_two, written out from its definition."""
    ang = (pos[..., None].float() * inv_freq).double()  # float32 angles, as transformers forms them
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    xe, xo = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack((xe * c - xo * s, xo * c + xe * s), -1).flatten(-2)


@pytest.mark.parametrize("model_type", ["llama", "gptj"])
def test_unrotate_inverts_rotate_exactly(model_type):
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64)
    cfg.model_type = model_type
    spec = rotary_spec_from_config(cfg)
    assert spec.adjacent_pairs == (model_type == "gptj")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 64, generator=g)
    pos = torch.randint(0, 4000, (2, 50), generator=g)
    y = spec.rotate(x, pos)
    back = spec.unrotate(y, pos)
    torch.testing.assert_close(back, x, rtol=0, atol=2e-5)
    assert (y - x).abs().max() > 0.1  # it did rotate
    if model_type == "gptj":
        ref = _reference_adjacent(x, pos, spec.inv_freq).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_half_split_matches_the_model(real_kv, model_dir):
    """Undoing RoPE on the model's cached keys gives the captured pre-RoPE keys."""
    from transformers import AutoConfig

    spec = rotary_spec_from_config(AutoConfig.from_pretrained(model_dir))
    k = torch.from_numpy(real_kv["layer1.k"])[None]
    pos = torch.arange(k.shape[2])[None]
    pre = spec.unrotate(k, pos)[0].numpy()
    np.testing.assert_allclose(pre, real_kv["layer1.k_pre_rope"], rtol=1e-4, atol=2e-4)


def test_captured_queries_give_the_models_attention_weights(model_dir, eval_text):
    """capture_kv's pre-RoPE queries of the last tokens, turned by ModelRope to their positions,
    against the cached (post-RoPE) keys give the model's own attention weights."""
    from kakeyaturbo.capture import capture_kv, read_tokens
    from kakeyaturbo.hf.rope import ModelRope
    from kakeyaturbo.modeling import kv_geometry, load_model

    model, tok = load_model(model_dir, attn="eager")
    ids = read_tokens(tok, eval_text, 96)
    n = 8
    kv = capture_kv(model, ids, last_queries=n)
    with torch.no_grad():
        want = model(torch.tensor([ids]), output_attentions=True).attentions
    geo = kv_geometry(model.config)
    group, t = geo.query_heads // geo.kv_heads, len(ids)
    causal = torch.arange(t)[None] <= torch.arange(t - n, t)[:, None]
    for layer in (0, geo.num_layers - 1):
        q_pre = torch.from_numpy(kv[f"layer{layer}.q_pre_rope"])
        assert q_pre.shape == (geo.query_heads, n, geo.head_dim)
        q = ModelRope(model.config).rotate(q_pre[None], layer, t - n)[0]
        keys = torch.from_numpy(kv[f"layer{layer}.k"]).repeat_interleave(group, 0)
        logits = (q @ keys.transpose(1, 2)) * geo.head_dim**-0.5
        got = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        torch.testing.assert_close(got, want[layer][0, :, t - n :], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("model_type", "factor"), [("llama", 1.0), ("gptj", 1.0), ("llama", 0.5)])
def test_paired_turn_is_rotate_in_paired_order(model_type, factor):
    """The complex-product RoPE that attention over the codes uses is rotate, channels
    reordered: both pairings, and a partial rotary dimension (unrotated channels kept)."""
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64)
    cfg.model_type, cfg.partial_rotary_factor = model_type, factor
    spec = rotary_spec_from_config(cfg)
    assert spec.rot_dim == int(64 * factor)
    order = spec.paired_order(64)
    assert sorted(order.tolist()) == list(range(64))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 64, generator=g)
    pos = torch.randint(0, 8000, (2, 40), generator=g)
    turned = spec.turn_paired(x[..., order].clone(), spec.rotation(pos, x.device))
    torch.testing.assert_close(turned, spec.rotate(x, pos)[..., order], rtol=0, atol=2e-5)
