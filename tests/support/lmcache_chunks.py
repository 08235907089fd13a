"""A ``kakeya`` chunk codec for kt-ref-a's geometry (6 layers, 2 KV heads x 64, RoPE theta
10,000) from a calibration bundle, and chunks of hostile content for it."""

from __future__ import annotations

import torch

KT_REF_A = {"num_layers": 6, "num_kv_heads": 2, "head_dim": 64, "rope_theta": 10000.0}


def ref_codec(bundle, **extra):
    from kakeyaturbo.lmcache.options import SerdeOptions
    from kakeyaturbo.lmcache.serde import build_codec

    return build_codec(SerdeOptions.from_kwargs({"bundle": str(bundle), **KT_REF_A, **extra}))


def hostile_chunk(kind: str, tokens: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """``[2, 6, tokens, 128]`` of one kind of content the codec must take within its bound."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 6, tokens, 128)
    if kind == "gauss":
        x = torch.randn(shape, generator=g)
    elif kind == "heavy":  # Student-t like: rare huge values
        x = torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp_min(1e-3)
    elif kind == "spikes":
        x = torch.zeros(shape)
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 97),), generator=g)
        x.view(-1)[idx] = 3e4 * torch.randn(idx.numel(), generator=g)
    elif kind == "const":
        x = torch.full(shape, 7.25)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "tiny":
        x = 1e-30 * torch.randn(shape, generator=g)
    elif kind == "huge":
        x = 6e4 * torch.randn(shape, generator=g).clamp(-1, 1)
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ("gauss", "heavy", "spikes", "const", "zeros", "tiny", "huge")
