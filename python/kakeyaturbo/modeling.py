"""Local Hugging Face models and evaluation text: load, tokenize, cut into passages.

No model hub is reachable from the machines this project runs on, so every function here takes a
local folder (anything `AutoModelForCausalLM.from_pretrained` accepts). Passages are cut
deterministically: `n` windows spread evenly over the tokenized text, so the same command always
scores the same tokens and no seed is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "KVGeometry",
    "Passage",
    "cut_passages",
    "kv_geometry",
    "load_model",
    "read_text",
    "tokenize_text",
]


@dataclass(frozen=True)
class KVGeometry:
    """What a model's KV cache looks like: one entry per decoder layer."""

    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" | ...
    sliding_window: int | None

    def cached_tokens(self, layer: int, tokens: int) -> int:
        """Tokens the cache of `layer` holds after `tokens` tokens (sliding layers saturate)."""
        if self.layer_types[layer] == "sliding_attention" and self.sliding_window:
            return min(tokens, self.sliding_window)
        return tokens


@dataclass(frozen=True)
class Passage:
    """One evaluation window: `ids` holds ctx + n_eval + 1 tokens starting at `start`."""

    index: int
    start: int
    ids: torch.Tensor


def load_model(path: str | Path, dtype: str = "float32", attn: str = "sdpa"):
    """Load a causal LM and its tokenizer from a local folder, in eval mode, on CPU.

    `dtype` is the compute dtype ("float32" or "bfloat16"); float32 is the default so that the
    only error in a comparison is the codec's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def kv_geometry(config) -> KVGeometry:
    """Read the KV-cache shape of a decoder from its config (text config for multimodal ones)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    n = cfg.num_hidden_layers
    sliding = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if sliding else "full_attention"] * n
    return KVGeometry(n, kv_heads, head_dim, tuple(types), sliding)


def read_text(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8")


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a whole document into one 1-D LongTensor, without special tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def cut_passages(ids: torch.Tensor, n: int, length: int) -> list[Passage]:
    """`n` windows of `length` tokens spread evenly over `ids` (non-overlapping when it fits).

    The first window starts at token 0 and the last one ends at the end of the text.
    """
    if n < 1 or length < 2:
        raise ValueError("need n >= 1 passages of length >= 2")
    total = int(ids.numel())
    if total < length:
        raise ValueError(f"text has {total} tokens, fewer than one passage of {length}")
    span = total - length
    starts = [0] if n == 1 else [round(i * span / (n - 1)) for i in range(n)]
    return [Passage(i, s, ids[s : s + length].clone()) for i, s in enumerate(starts)]
