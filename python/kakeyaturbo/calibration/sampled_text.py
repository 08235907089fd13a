"""Calibration text a model writes itself: token sequences sampled from the model at
temperature 1, from its BOS token. A bundle fitted on them needs no text from the user and
none of the evaluation text: the model's own distribution stands in for the text it will read
(on SmolLM2 such a bundle measured as well as one fitted on as many tokens of real prose,
``docs/recipe.md``)."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..hf._compat import CACHE_ARG
from ..hf.layer_plan import text_config

__all__ = ["sample_sequences"]


@torch.inference_mode()
def sample_sequences(
    model, tokens: int = 8192, batch: int = 32, seed: int = 0, progress: bool = True
) -> list[list[int]]:
    """``batch`` sequences of about ``tokens / batch`` tokens each, BOS first, sampled from the
    full distribution (no top-k or top-p: the statistics of what the model reads, not its
    best guesses); end-of-sequence tokens are never drawn, so every sequence runs its length.
    ``seed`` makes the draw repeatable; the caller's torch random state is left alone."""
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be at least 1, got {tokens} and {batch}")
    from transformers import DynamicCache

    cfg = text_config(model.config)
    bos = sorted(_ids(cfg, "bos_token_id") or _ids(model.config, "bos_token_id") or {0})[0]
    eos = _ids(cfg, "eos_token_id") | _ids(model.config, "eos_token_id")
    device = next(model.parameters()).device
    steps = max(1, math.ceil(tokens / batch) - 1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, 1), bos, dtype=torch.long)
    out = [ids]
    past = DynamicCache()
    for _ in tqdm(
        range(steps), desc="sampling calibration text", unit="step", disable=not progress
    ):
        logits = model(input_ids=ids.to(device), use_cache=True, **{CACHE_ARG: past}).logits
        logits = logits[:, -1].float().cpu()
        for e in eos:
            if e < logits.shape[-1]:
                logits[:, e] = -math.inf
        ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        out.append(ids)
    return torch.cat(out, dim=1).tolist()


def _ids(config, name: str) -> set[int]:
    """A config's token id field as a set (it may be None, one id or a list)."""
    v = getattr(config, name, None)
    if v is None:
        return set()
    return {int(x) for x in v} if isinstance(v, (list, tuple)) else {int(v)}
