"""The second-order estimate behind the sensitivity scan's in-forward KLs
(``kakeyaturbo.eval.fisher``): for a small error in one layer's keys or values it must match the
KL measured by running the model with that error, read from the cache (cached) and carried
through the prefill of the layers above (carried)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kakeyaturbo.eval.fisher import fisher_along
from kakeyaturbo.eval.metrics import passage_scores
from kakeyaturbo.hf import CACHE_ARG

CTX, N = 96, 16


class _Perturbing(DynamicCache):
    """Adds ``error`` to one layer's keys or values as the prefill hands them over."""

    def __init__(self, config, where, error):
        super().__init__(config=config)
        self.where, self.error = where, error

    def update(self, k, v, layer_idx, *args, **kwargs):
        if layer_idx == self.where[0] and k.shape[2] == self.error.shape[2]:
            if self.where[1] == "k":
                k = k + self.error
            else:
                v = v + self.error
        return super().update(k, v, layer_idx, *args, **kwargs)


def _kl(model, ids, logits_ref, cache) -> float:
    with torch.inference_mode():
        logits = model(input_ids=ids[:, CTX : CTX + N], **{CACHE_ARG: cache}).logits.float()
    return passage_scores(logits_ref, logits, ids[:, CTX + 1 : CTX + N + 1])[0].kl


@pytest.fixture(scope="module")
def setup(model_and_tok, wikitext_ids):
    model, _ = model_and_tok
    seq = wikitext_ids(0, 4000)[:, : CTX + N + 1]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=seq[:, :CTX], **{CACHE_ARG: cache})
    ref = _kl_ref(model, seq, cache)
    return model, seq, cache, ref


def _kl_ref(model, seq, cache):
    with torch.inference_mode():
        return model(input_ids=seq[:, CTX : CTX + N], **{CACHE_ARG: copy.deepcopy(cache)}).logits


@pytest.mark.parametrize("where", [(0, "k"), (1, "v")])
def test_estimates_match_measured_kl_of_a_small_error(setup, where):
    model, seq, cache, logits_ref = setup
    layer = cache.layers[where[0]]
    exact = layer.keys if where[1] == "k" else layer.values
    gen = torch.Generator().manual_seed(1)
    error = 0.05 * exact.abs().mean() * torch.randn(exact.shape, generator=gen)
    read = copy.deepcopy(cache)
    target = read.layers[where[0]]
    if where[1] == "k":
        target.keys = target.keys + error
    else:
        target.values = target.values + error
    cached_kl = _kl(model, seq, logits_ref, read)
    carried = _Perturbing(model.config, where, error)
    with torch.inference_mode():
        model(input_ids=seq[:, :CTX], **{CACHE_ARG: carried})
    carried_kl = _kl(model, seq, logits_ref, carried)

    est = fisher_along(model, seq[:, :CTX], seq[:, CTX : CTX + N], cache, {where: error}, 96)
    # 96 draws: the estimate's own spread is about sqrt(2 / 96) = 14% of it (seeded). A lost
    # factor 1/2, or gradients taken at the wrong positions, are off by 2x and more.
    assert est["cached"][where] == pytest.approx(cached_kl, rel=0.35)
    assert est["carried"][where] == pytest.approx(carried_kl, rel=0.35)
    # Layer 0's error travels through every layer above it: carried costs more than read.
    if where[0] == 0:
        assert carried_kl > 1.2 * cached_kl


def test_top_layer_has_nothing_to_carry_and_weights_stay_trainable(setup):
    model, seq, cache, _ = setup
    top = (model.config.num_hidden_layers - 1, "k")
    error = 0.05 * torch.randn(cache.layers[top[0]].keys.shape)
    est = fisher_along(model, seq[:, :CTX], seq[:, CTX : CTX + N], cache, {top: error}, 8)
    assert est["carried"][top] == pytest.approx(est["cached"][top], rel=1e-3)
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
