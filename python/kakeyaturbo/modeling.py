"""Local models and evaluation text: load, tokenize, cut into passages.

No model hub is reachable from the machines this project runs on, so every function here takes a
local path: a Hugging Face model folder (anything `AutoModelForCausalLM.from_pretrained`
accepts), a GGUF file, or a folder holding one GGUF file and no `config.json`. A GGUF is
dequantised once, by transformers' own GGUF loader, into a float32 Hugging Face folder in the
model cache (`resolve_model_dir`), and every later load reads that folder. Passages are cut
deterministically: `n` windows spread evenly over the tokenized text, so the same command always
scores the same tokens and no seed is involved.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "KVGeometry",
    "Passage",
    "cache_dir",
    "copy_passages",
    "cut_passages",
    "find_gguf",
    "heads_first",
    "kv_geometry",
    "load_model",
    "pre_rope_modules",
    "read_text",
    "resolve_model_dir",
    "tokenize_text",
]


@dataclass(frozen=True)
class KVGeometry:
    """What a model's KV cache looks like: one entry per decoder layer."""

    num_layers: int
    query_heads: int
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
    """Load a causal LM and its tokenizer from a local path, in eval mode, on CPU.

    `path` is a Hugging Face model folder, a GGUF file or a folder holding one GGUF file (see
    `resolve_model_dir`: a GGUF is converted once, then loaded from the cache). `dtype` is the
    compute dtype ("float32" or "bfloat16"); float32 is the default so that the only error in a
    comparison is the codec's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def cache_dir() -> Path:
    """kakeyaturbo's cache: `$KAKEYATURBO_CACHE`, by default `~/.cache/kakeyaturbo` (under
    `$XDG_CACHE_HOME` when that is set). Converted models live in its `models/` folder."""
    root = os.environ.get("KAKEYATURBO_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kakeyaturbo"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `*.gguf` in a folder without a
    `config.json`. None for a Hugging Face folder; an error for anything else."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: expected a .gguf file or a model folder")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model file or folder")
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        what = "no .gguf file" if not ggufs else f"{len(ggufs)} .gguf files (name one)"
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model folder (no config.json) and holds {what}"
        )
    return ggufs[0]


def resolve_model_dir(path: str | Path, cache: str | Path | None = None) -> Path:
    """The Hugging Face folder to load for `path`.

    A Hugging Face folder is returned as it is. A GGUF (`find_gguf`) maps to
    `<cache>/models/<stem>-<first 12 hex digits of its sha256>/` (`cache` defaults to
    `cache_dir()`), which is written on first use: transformers dequantises the GGUF to
    float32 (about 25 s for SmolLM2-135M on two cores), the config loses its
    `quantization_config`, and model and tokenizer are saved to a temporary folder that is then
    renamed into place, so an interrupted conversion never leaves a folder that looks finished.
    The key is the file's content (hashing 100 MB takes about 0.1 s), so a changed file gets a
    fresh conversion.
    """
    gguf = find_gguf(path)
    if gguf is None:
        return Path(path)
    digest = _sha256(gguf)
    root = (Path(cache) if cache is not None else cache_dir()) / "models"
    out = root / f"{gguf.stem}-{digest[:12]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    print(f"kakeyaturbo: converting {gguf} to float32 once, into {out}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=root))
    try:
        _convert_gguf(gguf, tmp)
        (tmp / "kakeyaturbo-source.json").write_text(
            json.dumps({"gguf": str(gguf.resolve()), "sha256": digest}, indent=2) + "\n"
        )
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` with transformers' GGUF loader; save a float32 model folder to `out`."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"loading {gguf.name} needs the gguf package: pip install 'kakeyaturbo[hf]'",
            name="gguf",
        )
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The weights are plain float32 tensors now; without these two transformers refuses to save
    # ("quantized with gguf and is not serializable") and would reload through the GGUF path.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def pre_rope_modules(attn) -> tuple:
    """The modules of an attention block whose outputs are its pre-RoPE queries, keys and
    values: ``q_norm`` / ``k_norm`` where the model normalises them (Qwen3, Gemma 3), else the
    projections. Capture and calibration hook these, so both see the keys RoPE rotates."""
    q = getattr(attn, "q_norm", None) or attn.q_proj
    k = getattr(attn, "k_norm", None) or attn.k_proj
    return q, k, attn.v_proj


def heads_first(out, tokens: int, head_dim: int):
    """A pre-RoPE module's output as ``[batch, heads, tokens, head_dim]``, whatever layout the
    family gives it: ``[B, T, H * D]`` (projections), ``[B, T, H, D]`` (Qwen3's norms) or
    ``[B, H, T, D]`` (Gemma 3 normalises after moving heads first)."""
    if out.dim() == 3:
        return out.reshape(out.shape[0], tokens, -1, head_dim).transpose(1, 2)
    if out.dim() == 4 and out.shape[-1] == head_dim:
        if out.shape[1] == tokens and out.shape[2] != tokens:
            return out.transpose(1, 2)
        if out.shape[2] == tokens:
            return out
    raise ValueError(
        f"cannot read a pre-RoPE output of shape {tuple(out.shape)} as {tokens} tokens of "
        f"head_dim {head_dim}"
    )


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
    return KVGeometry(n, heads, kv_heads, head_dim, tuple(types), sliding)


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


def copy_passages(ids: torch.Tensor, n: int, length: int) -> list[Passage]:
    """The copying test: `n` windows of `ceil(length / 2)` tokens, each written twice and cut to
    `length`. A model that copies exactly predicts the second copy from the first, so any error
    in the first copy's keys and values shows in the tokens scored there (the scored tokens of a
    ctx + n_eval + 1 passage with n_eval <= ctx - 1 all lie in the second copy)."""
    half = (length + 1) // 2
    return [
        Passage(p.index, p.start, torch.cat([p.ids, p.ids])[:length])
        for p in cut_passages(ids, n, half)
    ]
