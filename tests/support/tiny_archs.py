"""Tiny randomly initialised Gemma 3-style and Qwen3-style models for the architecture tests
(``tests/unit/test_architectures*.py``): the models, token ids, their pre-RoPE q/k/v as the
hooks of ``pre_rope_modules`` see them, and a calibration bundle fitted on those."""

from __future__ import annotations

import functools

import torch
import transformers as tf

import kakeyaturbo as kt
from kakeyaturbo.calibration import Calibration, model_fingerprint
from kakeyaturbo.calibration.fit import _Moments, fit_bundle
from kakeyaturbo.hf import CACHE_ARG
from kakeyaturbo.modeling import pre_rope_modules

ARCHS = ("gemma3", "qwen3")
MODES = ("snapshot", "in-forward")
ARCH_MODES = [(arch, mode) for arch in ARCHS for mode in MODES]
VOCAB = 256
WINDOW = 64  # Gemma 3 sliding window: the sliding layers' cache holds WINDOW - 1 tokens
GEMMA3_TYPES = ["sliding_attention", "full_attention"] * 2
CTX, N_EVAL, BLOCK = 512, 16, 128  # 4 whole blocks per full layer
P8 = kt.CodecParams(
    allocation="waterfill", k=0, bits_per_value=8, block_size=BLOCK, pca_method="none"
)


COMMON = dict(
    num_hidden_layers=4,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    initializer_range=0.1,  # less flat attention than the default 0.02
)


@functools.cache
def tiny(arch: str):
    """A seeded, randomly initialised float32 model in eval mode."""
    if arch == "gemma3":
        return tiny_gemma3(WINDOW)
    if arch != "qwen3":
        raise KeyError(arch)
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, **COMMON
    )
    return tf.Qwen3ForCausalLM(cfg).float().eval()


@functools.cache
def tiny_gemma3(window: int):
    """The Gemma 3-style model (sliding, full, sliding, full) with sliding window ``window``."""
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=window,
        layer_types=GEMMA3_TYPES,
        **COMMON,
    )
    return tf.Gemma3ForCausalLM(cfg).float().eval()


def token_ids(rows: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


def sliding_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None) or []
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _bthd(out: torch.Tensor, tokens: int, head_dim: int) -> torch.Tensor:
    """A pre-RoPE module's output as [B, T, H, D], whatever the family's layout."""
    if out.dim() == 3:  # a projection: [B, T, H*D]
        return out.reshape(out.shape[0], out.shape[1], -1, head_dim)
    if out.shape[2] == tokens and out.shape[1] != tokens:  # Gemma 3: norms after the transpose
        return out.transpose(1, 2)
    return out  # Qwen3: [B, T, H, D]


@torch.inference_mode()
def pre_rope_qkv(model, ids: torch.Tensor, cache=None) -> dict[int, tuple]:
    """Run ``ids`` [B, T]; returns {layer: (q, k, v)} as [B, H, T, D] float32, taken from the
    outputs of ``pre_rope_modules`` (the queries and keys RoPE rotates)."""
    d = model.config.head_dim
    got: dict[tuple[int, int], torch.Tensor] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        for j, mod in enumerate(pre_rope_modules(layer.self_attn)):

            def hook(_m, _i, out, key=(li, j)):
                got[key] = out.detach().clone()

            hooks.append(mod.register_forward_hook(hook))
    try:
        model(ids, **{CACHE_ARG: cache}, use_cache=cache is not None)
    finally:
        for h in hooks:
            h.remove()
    t = ids.shape[1]
    return {
        li: tuple(_bthd(got[(li, j)], t, d).transpose(1, 2).float() for j in range(3))
        for li in range(len(model.model.layers))
    }


CALIB_TOKENS, CALIB_CTX = 768, 256


def hand_moments(model) -> list[_Moments]:
    """The calibration moments, collected with this module's layout-aware hooks."""
    cfg = model.config
    moments = [_Moments(cfg.num_key_value_heads, cfg.head_dim) for _ in model.model.layers]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    ids = token_ids(1, CALIB_TOKENS, seed=2)
    for lo in range(0, CALIB_TOKENS, CALIB_CTX):
        qkv = pre_rope_qkv(model, ids[:, lo : lo + CALIB_CTX])
        for li, m in enumerate(moments):
            q, k, v = (x[0].transpose(0, 1).double().numpy() for x in qkv[li])  # [T, H, D]
            m.add(q, k, v, group)
    return moments


@functools.cache
def bundle(arch: str) -> Calibration:
    model = tiny(arch)
    moments = hand_moments(model)
    return Calibration(
        fingerprint=model_fingerprint(model),
        tensors=fit_bundle(moments),
        meta={"tokens": CALIB_TOKENS, "ctx": CALIB_CTX},
    )
