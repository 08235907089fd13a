"""A Llama-style checkpoint run with Gemma 3's layer pattern: sliding-window attention in five of
every six layers, full attention in the sixth. The weights are the checkpoint's, so the model
is a real one (its own reference for every codec), and the cache holds what a Gemma 3 or
Mistral-style cache holds: a window of the newest tokens in most layers.

The copy is a transformers Qwen2 model (Llama's computation plus q/k/v biases, here zero, and
per-layer ``layer_types``), which is how the sliding layers are expressed without a custom
model class.
"""

from __future__ import annotations

import torch

#: Gemma 3's pattern and window (1 full layer in 6; 512 tokens).
FULL_EVERY, WINDOW = 6, 512


def with_sliding_layers(model, window: int = WINDOW, full_every: int = FULL_EVERY):
    """A copy of the Llama-style ``model`` whose layers ``i`` with ``(i + 1) % full_every != 0``
    attend to the newest ``window`` tokens only (the others, as before, to all)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = model.config
    if cfg.model_type != "llama":
        raise ValueError(f"with_sliding_layers takes a llama model, not {cfg.model_type!r}")
    if window < 2 or full_every < 1:
        raise ValueError(f"window must be >= 2 and full_every >= 1, got {window}, {full_every}")
    n = cfg.num_hidden_layers
    types = [
        "full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(n)
    ]
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    out_cfg = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=cfg.tie_word_embeddings,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        layer_types=types,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )
    out_cfg._attn_implementation = getattr(cfg, "_attn_implementation", None) or "sdpa"
    out = Qwen2ForCausalLM(out_cfg).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = out.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("_proj.bias") and k != "lm_head.weight" for k in missing):
        raise ValueError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for layer in out.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.zero_()
    if cfg.tie_word_embeddings:
        out.tie_weights()
    return out.eval()
