"""Calibration text a model writes itself: token sequences sampled from the model at
temperature 1, every other one from its BOS token alone and the others from BOS and the opening
of a program or a markup file. A bundle fitted on them needs no text from the user and none of
the evaluation text: the model's own distribution stands in for the text it will read (on
SmolLM2 such a bundle measured as well as one fitted on as many tokens of real prose,
``docs/recipe.md``). From BOS alone a model writes mostly prose (SmolLM2: nearly every sample),
and a bundle fitted on prose alone codes source code worse (``docs/calibration.md``)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from tqdm.auto import tqdm

from ..hf._compat import CACHE_ARG
from ..hf.layer_plan import text_config

__all__ = ["OPENINGS", "opening_ids", "sample_sequences"]

#: Openings of source code and markup that every other sampled sequence starts from.
OPENINGS = (
    "def ",
    "import ",
    "#include <",
    "class ",
    "function ",
    "public static void ",
    "SELECT ",
    "<!DOCTYPE html>\n",
    "```python\n",
    "fn main() {\n",
    "package main\n\n",
    "#!/bin/bash\n",
    '{\n  "',
    "\\begin{",
    "<?php\n",
    "const ",
)


@torch.inference_mode()
def sample_sequences(
    model,
    tokens: int = 8192,
    batch: int = 32,
    seed: int = 0,
    progress: bool = True,
    openings: Optional[list[list[int]]] = None,
) -> list[list[int]]:
    """``batch`` sequences of about ``tokens / batch`` tokens each, BOS first, sampled from the
    full distribution (no top-k or top-p: the statistics of what the model reads, not its
    best guesses); end-of-sequence tokens are never drawn, so every sequence runs its length.
    ``openings`` (token ids, e.g. :func:`opening_ids`): sequence ``2 i + 1`` is given
    ``openings[i % len(openings)]`` after BOS before it samples. ``seed`` makes the draw
    repeatable; the caller's torch random state is left alone."""
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be at least 1, got {tokens} and {batch}")
    from transformers import DynamicCache

    cfg = text_config(model.config)
    bos = sorted(_ids(cfg, "bos_token_id") or _ids(model.config, "bos_token_id") or {0})[0]
    eos = _ids(cfg, "eos_token_id") | _ids(model.config, "eos_token_id")
    device = next(model.parameters()).device
    steps = max(1, math.ceil(tokens / batch) - 1)
    gen = torch.Generator().manual_seed(seed)
    forced = {i: openings[(i // 2) % len(openings)] for i in range(1, batch, 2)} if openings else {}
    ids = torch.full((batch, 1), bos, dtype=torch.long)
    out = [ids]
    past = DynamicCache()
    for step in tqdm(
        range(steps), desc="sampling calibration text", unit="step", disable=not progress
    ):
        logits = model(input_ids=ids.to(device), use_cache=True, **{CACHE_ARG: past}).logits
        logits = logits[:, -1].float().cpu()
        for e in eos:
            if e < logits.shape[-1]:
                logits[:, e] = -math.inf
        ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        for i, opening in forced.items():  # (drawn all the same: one draw per step and row)
            if step < len(opening):
                ids[i, 0] = opening[step]
        out.append(ids)
    return torch.cat(out, dim=1).tolist()


def opening_ids(model) -> Optional[list[list[int]]]:
    """:data:`OPENINGS` in the tokens of ``model``'s tokenizer (the one saved beside its
    weights, ``model.name_or_path``); None where there is none (every sequence then starts
    from BOS alone)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model.name_or_path)
        ids = [tok(o, add_special_tokens=False)["input_ids"] for o in OPENINGS]
    except Exception:  # noqa: BLE001 - no tokenizer to be found: prose from BOS only
        return None
    return [i for i in ids if i] or None


def _ids(config, name: str) -> set[int]:
    """A config's token id field as a set (it may be None, one id or a list)."""
    v = getattr(config, name, None)
    if v is None:
        return set()
    return {int(x) for x in v} if isinstance(v, (list, tuple)) else {int(v)}
