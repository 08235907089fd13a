"""How much an error in one layer's cached keys or values moves the scored logits, to second
order, for every layer at once: the Fisher information of the output along the error.

For a small change ``e`` of the cache, the KL of the next-token distribution is about
``1/2 e^T F e`` with ``F = E_y[g g^T]``, ``g`` the gradient of ``log p(y)`` and ``y`` drawn from
the model's own distribution. With one ``y`` drawn per scored position and ``G`` the gradient
of their summed log-likelihoods, the cross terms between positions have mean zero, so
``1/2 (G . e)^2`` is an unbiased estimate of the summed KL; one backward pass gives it for
every layer and stream. Two protocols share the draws:

- **cached** (snapshot): the gradient with respect to the prefix cache the continuation reads;
- **carried** (in-forward): the gradient with respect to the keys and values as the prefill
  makes them, so an error also reaches the scored tokens through the layers above it.

Their ratio is how much carrying an error through the layers above amplifies it, which is what
the sensitivity scan takes from here (the KL of the snapshot protocol itself is measured, not
estimated).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kakeyaturbo.hf._compat import CACHE_ARG

__all__ = ["fisher_along"]


class _KeepingCache(DynamicCache):
    """A `DynamicCache` that remembers the keys and values each layer was handed."""

    def __init__(self, config):
        super().__init__(config=config)
        self.handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.handed[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _frozen(model):
    """The parameters that require a gradient, switched off for the duration (only the
    gradients with respect to the cache are wanted)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    return params


def fisher_along(
    model,
    prefix: torch.Tensor,
    cont: torch.Tensor,
    cache: DynamicCache,
    errors: dict[tuple[int, str], torch.Tensor],
    samples: int = 4,
    seed: int = 0,
) -> dict[str, dict[tuple[int, str], float]]:
    """``1/2 E[(G . e)^2]`` per scored token, for each ``(layer, "k"|"v")`` error ``e`` of the
    prefix (``[B, H, ctx, D]``, as the cache holds it), in the ``"cached"`` and ``"carried"``
    protocols, averaged over ``samples`` draws and the batch rows. ``cache`` is the exact
    prefill of ``prefix`` (not modified); ``cont`` the scored continuation (``[B, n]``)."""
    ctx, n = prefix.shape[1], cont.shape[1]
    gen = torch.Generator().manual_seed(seed)
    frozen = _frozen(model)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            # cached: the continuation on a copy of the prefix cache whose tensors are leaves
            leaves = DynamicCache(config=model.config)
            wanted = sorted(errors)
            inputs: dict[tuple[int, str], torch.Tensor] = {}
            for li, layer in enumerate(cache.layers):
                k = layer.keys.clone().requires_grad_(True)
                v = layer.values.clone().requires_grad_(True)
                inputs[(li, "k")], inputs[(li, "v")] = k, v
                leaves.update(k, v, li)
            logits = model(input_ids=cont, **{CACHE_ARG: leaves}, use_cache=True).logits
            cached_lp = torch.log_softmax(logits.float(), dim=-1)
            probs = cached_lp.detach().exp().reshape(-1, cached_lp.shape[-1])
            draws = [
                torch.multinomial(probs, 1, generator=gen).reshape(cont.shape)
                for _ in range(samples)
            ]
            cached = _estimates(cached_lp, [inputs[w] for w in wanted], wanted, errors, draws)
            # carried: prefix and continuation in one pass; gradients at the prefix positions
            keeping = _KeepingCache(model.config)
            ids = torch.cat([prefix, cont], dim=1)
            # The graph starts at the embeddings (the weights take no gradient).
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model(
                inputs_embeds=embeds, **{CACHE_ARG: keeping}, use_cache=True, logits_to_keep=n
            )
            carried_lp = torch.log_softmax(out.logits.float(), dim=-1)
            handed = [keeping.handed[li][0 if s == "k" else 1] for li, s in wanted]
            carried = _estimates(carried_lp, handed, wanted, errors, draws, ctx)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return {"cached": cached, "carried": carried}


def _estimates(log_probs, tensors, wanted, errors, draws, ctx=None) -> dict:
    """Mean over draws and rows of ``1/2 (G . e)^2 / n`` for each wanted stream."""
    b, n = draws[0].shape
    sums = {w: 0.0 for w in wanted}
    for r, y in enumerate(draws):
        ll = log_probs.gather(-1, y.unsqueeze(-1)).sum()
        grads = torch.autograd.grad(ll, tensors, retain_graph=r < len(draws) - 1)
        for w, g in zip(wanted, grads):
            g = g if ctx is None else g[:, :, :ctx]
            dots = (g.double() * errors[w].double()).sum(dim=(1, 2, 3))  # one per row
            sums[w] += float((0.5 * dots**2).sum()) / n
    return {w: v / (len(draws) * b) for w, v in sums.items()}
