"""Prefill, compress, teacher-force, compare: the perplexity protocol.

For each passage of ctx + n_eval + 1 tokens:

1. prefill the first `ctx` tokens with an ordinary `DynamicCache` (the reference prefix cache);
2. build the method's cache for that prefix:
   - snapshot mode: every layer's K/V of the reference prefill is compressed and decoded in
     place (all layers computed from exact K/V, as when a finished prefill is stored);
   - in-forward mode: the prefill runs again through a cache whose `update` compresses each
     layer's K/V before attention uses them, so every layer sees hidden states computed from the
     reconstructed K/V of the layers before it (errors compound with depth);
   - in-forward-hot mode: in-forward, but each query of the prefill reads its newest
     `hot_window.HOT_WINDOW` tokens exact, as tokens generated through `KakeyaCache` read its
     hot window (`eval/hot_window.py`; with `window_values=int8` their values as int8 rows, as
     `KakeyaCache`'s default holds them);
3. teacher-force the next `n_eval` tokens on top of it (their own K/V are not compressed) and
   score the predictions of tokens ctx+1 .. ctx+n_eval against the uncompressed run.

Every scored position therefore reads the compressed prefix. The reference logits come from
the same code path with the prefix left as computed, so a method that changes nothing scores
exactly delta-ppl 0 and top-1 100%. Batch rows are independent passages; methods must not mix
them (transformers' own quantized caches are run one passage at a time for that reason).
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

import kakeyaturbo.hf.int8_rows as int8_rows
from kakeyaturbo.eval import hot_window
from kakeyaturbo.eval.baselines import bf16_round
from kakeyaturbo.eval.hf_baselines import HFQuantizedCache
from kakeyaturbo.eval.methods import ByteCount, Method
from kakeyaturbo.eval.metrics import PassageScores, passage_scores, summarize
from kakeyaturbo.hf._compat import CACHE_ARG
from kakeyaturbo.hf.rope import ModelRope
from kakeyaturbo.modeling import Passage

__all__ = [
    "CompressingCache",
    "Reference",
    "compress_stream",
    "continue_logits",
    "evaluate_method",
    "prepare_reference",
    "sliding_layer",
]

MODES = ("snapshot", "in-forward", "in-forward-hot")


def _add(a: ByteCount, b: ByteCount) -> None:
    for k, v in b.items():
        a[k] = a.get(k, 0) + int(v)


def compress_stream(
    method: Method,
    x: torch.Tensor,
    layer: int,
    stream: str,
    rope: ModelRope | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, list[ByteCount]]:
    """Apply `method` to one layer's K or V ([B, H, T, D], token i at position start + i) with
    its shared options (sinks, recent window, skipped layers, stream choice, pre-RoPE keys);
    returns the reconstruction and per-row bytes. A sliding window's tokens (start > 0) hold no
    sinks: the sequence's first tokens left it."""
    opts = method.options
    b, h, t, d = x.shape
    keep = bf16_round if opts.passthrough == "bf16" else (lambda y: y)

    def full(tokens: int) -> int:
        return h * tokens * d * 2

    if not opts.compresses(layer, stream):
        return keep(x), [{"full_precision": full(t)} for _ in range(b)]
    s = min(opts.sink_tokens, t) if start == 0 else 0
    w = min(opts.residual_length, t - s)
    rows: list[ByteCount] = [{} for _ in range(b)]
    parts = []
    # Methods that hold sinks inside their stream (the codec's pipeline) get the prefix from
    # token 0 and return the sinks as given; the others never see them.
    in_place = getattr(method, "codes_sinks_in_place", False) and t - s - w > 0
    lo = 0 if in_place else s
    if s and lo:
        parts.append(keep(x[:, :, :s]))
    if t - s - w > 0:
        mid = x[:, :, lo : t - w].contiguous()
        unrope = opts.pre_rope and stream == "k"
        if unrope:
            if rope is None:
                raise ValueError(f"{method.spec}: pre_rope=true but no rotary embedding given")
            mid = rope.unrotate(mid, layer, start + lo).contiguous()
        if in_place:  # the stream's first s tokens are its sinks (none in a sliding window)
            mid_hat, mid_rows = method.compress(mid, layer, stream, sink_tokens=s)
        else:
            mid_hat, mid_rows = method.compress(mid, layer, stream)
        if mid_hat.shape != (b, h, t - lo - w, d):
            raise RuntimeError(f"{method.spec}: reconstruction has shape {tuple(mid_hat.shape)}")
        if unrope:
            mid_hat = rope.rotate(mid_hat.float(), layer, start + lo)
        mid_hat = mid_hat.to(x.dtype)
        if s and not lo:
            mid_hat[:, :, :s] = keep(x[:, :, :s])
        parts.append(mid_hat)
        for r, m in zip(rows, mid_rows):
            _add(r, m)
    # The recent window's values as KakeyaCache(int8_hot_values=True) holds them.
    int8_window = stream == "v" and opts.window_values == "int8"
    if w:
        recent = x[:, :, t - w :]
        parts.append(int8_rows.round_trip(recent) if int8_window else keep(recent))
    exact = s if int8_window else s + w
    held: ByteCount = {"full_precision": full(exact)} if exact else {}
    if int8_window and w:
        held["int8_window"] = h * w * (d + int8_rows.SCALE_BYTES)
    for r in rows:
        _add(r, held)
    x_hat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return x_hat, rows


class CompressingCache(DynamicCache):
    """A `DynamicCache` that compresses K/V inside the forward pass while `active` is set."""

    def __init__(self, method: Method, config, rope: ModelRope | None = None):
        super().__init__(config=config)
        self.method = method
        self.rope = rope
        self.active = True
        self.rows: list[ByteCount] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.active and codes_layer(self.method, self, layer_idx):
            int8_values = self.method.options.window_values == "int8"
            hot_window.stash(layer_idx, key_states, value_states, int8_values)
            t = key_states.shape[-2]
            # A sliding layer keeps its newest window - 1 tokens: those are what it holds
            # (counted); the older ones are coded as well (this forward reads them coded) but
            # dropped by the layer.
            held = t
            if sliding_layer(self, layer_idx):
                held = min(t, self.layers[layer_idx].sliding_window - 1)
            k_parts, v_parts, rows = [], [], None
            for lo, hi in ((0, t - held), (t - held, t)):
                if hi == lo:
                    continue
                k, rk = compress_stream(
                    self.method, key_states[:, :, lo:hi], layer_idx, "k", self.rope, lo
                )
                v, rv = compress_stream(
                    self.method, value_states[:, :, lo:hi], layer_idx, "v", self.rope, lo
                )
                k_parts.append(k)
                v_parts.append(v)
                rows = [{} for _ in rk]
                for r, a, b in zip(rows, rk, rv):
                    _add(r, a)
                    _add(r, b)
            key_states, value_states = torch.cat(k_parts, dim=-2), torch.cat(v_parts, dim=-2)
            if self.rows is None:
                self.rows = [{} for _ in rows]
            for r, a in zip(self.rows, rows):
                _add(r, a)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@dataclass
class Batch:
    passages: list[Passage]
    prefix: torch.Tensor  # [B, ctx]
    cont: torch.Tensor  # [B, n_eval]
    targets: torch.Tensor  # [B, n_eval]
    cache: DynamicCache  # the reference prefill cache (not to be modified)
    logits: torch.Tensor  # [B, n_eval, V] reference continuation logits


@dataclass
class Reference:
    ctx: int
    n_eval: int
    batches: list[Batch] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passages(self) -> list[Passage]:
        return [p for b in self.batches for p in b.passages]


def _prefill(model, prefix: torch.Tensor, cache) -> None:
    model(input_ids=prefix, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)


def continue_logits(model, cache, cont: torch.Tensor) -> torch.Tensor:
    return model(input_ids=cont, **{CACHE_ARG: cache}, use_cache=True).logits.float()


@torch.inference_mode()
def prepare_reference(
    model, passages: list[Passage], ctx: int, n_eval: int, batch: int = 16, progress=None
) -> Reference:
    """Run the uncompressed prefill and continuation of every passage, `batch` at a time."""
    need = ctx + n_eval + 1
    for p in passages:
        if p.ids.numel() < need:
            raise ValueError(
                f"passage {p.index} has {p.ids.numel()} tokens, need ctx + n_eval + 1 = {need}"
            )
    ref = Reference(ctx, n_eval)
    t0 = time.perf_counter()
    for i in range(0, len(passages), batch):
        group = passages[i : i + batch]
        ids = torch.stack([p.ids[:need] for p in group])
        cache = DynamicCache(config=model.config)
        _prefill(model, ids[:, :ctx], cache)
        logits = continue_logits(model, copy.deepcopy(cache), ids[:, ctx : ctx + n_eval])
        ref.batches.append(
            Batch(
                group,
                ids[:, :ctx],
                ids[:, ctx : ctx + n_eval],
                ids[:, ctx + 1 : need],
                cache,
                logits,
            )
        )
        if progress is not None:
            progress.update(len(group))
    ref.seconds = time.perf_counter() - t0
    return ref


def _bf16_bytes(cache) -> int:
    """bf16 bytes of one passage's prefix in `cache` (K and V, every layer, as cached)."""
    return sum(2 * (layer.keys[0].numel() + layer.values[0].numel()) for layer in cache.layers)


def _rope(model, method: Method) -> ModelRope | None:
    return ModelRope(model.config) if method.options.pre_rope else None


def _run_snapshot(model, method: Method, batch: Batch) -> tuple[torch.Tensor, list[ByteCount]]:
    rope = _rope(model, method)
    cache = copy.deepcopy(batch.cache)
    rows: list[ByteCount] = [{} for _ in batch.passages]
    ctx = batch.prefix.shape[-1]
    for li, layer in enumerate(cache.layers):
        if not codes_layer(method, cache, li):
            continue  # counted by _held_sliding_bytes
        start = ctx - layer.keys.shape[-2]  # a sliding layer holds the newest tokens only
        k_hat, rk = compress_stream(method, layer.keys, li, "k", rope, start)
        v_hat, rv = compress_stream(method, layer.values, li, "v", rope, start)
        layer.keys, layer.values = k_hat, v_hat
        for r, a, b in zip(rows, rk, rv):
            _add(r, a)
            _add(r, b)
    _held_sliding_bytes(method, cache, rows)
    return continue_logits(model, cache, batch.cont), rows


def sliding_layer(cache, layer: int) -> bool:
    """Whether ``layer`` of ``cache`` is a sliding-window layer (it holds a bounded window)."""
    return layer < len(cache.layers) and bool(getattr(cache.layers[layer], "is_sliding", False))


def codes_layer(method: Method, cache, layer: int) -> bool:
    """Whether ``method`` codes ``layer``'s cache: every full-attention layer, and sliding ones
    with ``sliding=code`` (by default they hold their window exact, as in KakeyaCache)."""
    return method.options.sliding == "code" or not sliding_layer(cache, layer)


def _held_sliding_bytes(method: Method, cache, rows: list[ByteCount]) -> None:
    """Add each sliding layer's held tokens that ``method`` holds exact, at bf16, to every row's
    full-precision bytes."""
    for li, layer in enumerate(cache.layers):
        if not codes_layer(method, cache, li):
            for r, row in enumerate(rows):
                n = layer.keys[r].numel() + layer.values[r].numel()
                _add(row, {"full_precision": 2 * n})


def _run_in_forward(
    model, method: Method, batch: Batch, hot: bool = False
) -> tuple[torch.Tensor, list[ByteCount]]:
    cache = CompressingCache(method, model.config, _rope(model, method))
    with hot_window.exact_window(model) if hot else nullcontext():
        _prefill(model, batch.prefix, cache)
    cache.active = False
    rows = cache.rows or [{} for _ in batch.passages]
    _held_sliding_bytes(method, cache, rows)
    return continue_logits(model, cache, batch.cont), rows


def _run_hf(
    model, method: HFQuantizedCache, batch: Batch
) -> tuple[torch.Tensor, list[ByteCount], list[int]]:
    logits, rows, allocated = [], [], []
    for i in range(len(batch.passages)):
        cache = method.make_cache(model.config)
        counted: ByteCount = {}
        alloc = 0
        for li, layer in enumerate(batch.cache.layers):
            # what the model's prefill does: the first update quantizes the whole prefix
            cache.update(layer.keys[i : i + 1].clone(), layer.values[i : i + 1].clone(), li)
            c, a = method.count(cache.layers[li])
            _add(counted, c["k"])
            _add(counted, c["v"])
            alloc += a
        logits.append(continue_logits(model, cache, batch.cont[i : i + 1]))
        rows.append(counted)
        allocated.append(alloc)
    return torch.cat(logits), rows, allocated


def _ci(pair: tuple[float, float]) -> list[float | None]:
    return [None if v != v else v for v in pair]  # NaN -> null in JSON


@torch.inference_mode()
def evaluate_method(
    model, ref: Reference, method: Method, mode: str = "snapshot", progress=None
) -> dict[str, Any]:
    """Score one method against the reference; returns its JSON row (see `eval ppl`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    method.prepare(model)
    row: dict[str, Any] = {**method.describe(), "mode": mode}
    reason = getattr(method, "reason", None)
    if isinstance(method, HFQuantizedCache):
        if mode != "snapshot":
            reason = reason or "transformers' QuantizedCache runs as shipped, in snapshot mode only"
        elif not method.options.is_default():
            reason = reason or "transformers' QuantizedCache takes none of the shared options"
    elif mode != "snapshot" and not method.supports_in_forward:
        reason = f"{method.name} does not run in-forward"
    if reason:
        if progress is not None:
            progress.update(len(ref.passages))
        return {**row, "skipped": reason}
    t0 = time.perf_counter()
    scores: list[PassageScores] = []
    byte_rows: list[ByteCount] = []
    allocated: list[int] = []
    bf16 = []
    for batch in ref.batches:
        if isinstance(method, HFQuantizedCache):
            logits, rows, alloc = _run_hf(model, method, batch)
            allocated.extend(alloc)
        elif mode == "snapshot":
            logits, rows = _run_snapshot(model, method, batch)
        else:
            logits, rows = _run_in_forward(model, method, batch, hot=mode == "in-forward-hot")
        scores.extend(passage_scores(batch.logits, logits, batch.targets))
        byte_rows.extend(rows)
        bf16.extend([_bf16_bytes(batch.cache)] * len(batch.passages))
        if progress is not None:
            progress.update(len(batch.passages))
    seconds = time.perf_counter() - t0
    s = summarize(scores)
    stored = [sum(r.values()) for r in byte_rows]
    breakdown: ByteCount = {}
    for r in byte_rows:
        _add(breakdown, r)
    n = len(stored)
    mean_stored = sum(stored) / n
    row.update(
        delta_ppl=s.delta_ppl,
        delta_ppl_ci=_ci(s.delta_ppl_ci),
        kl=s.kl,
        kl_ci=_ci(s.kl_ci),
        top1=s.top1,
        top1_ci=_ci(s.top1_ci),
        verdict=s.verdict,
        ppl_ref=s.ppl_ref,
        ppl=s.ppl_alt,
        tokens=s.tokens,
        stored_bytes=int(mean_stored) if mean_stored == int(mean_stored) else mean_stored,
        bf16_bytes=bf16[0] if len(set(bf16)) == 1 else sum(bf16) / n,
        ratio=(sum(bf16) / sum(stored)) if sum(stored) else None,
        bytes_breakdown={k: v / n for k, v in sorted(breakdown.items())},
        seconds=round(seconds, 3),
    )
    if allocated:
        row["allocated_bytes"] = sum(allocated) / n
    row["passages"] = [
        {
            "index": p.index,
            "start": p.start,
            "nll_ref": sc.nll_ref,
            "nll": sc.nll_alt,
            "delta_ppl": float(torch.tensor(sc.nll_alt - sc.nll_ref).expm1()),
            "kl": sc.kl,
            "top1": sc.top1,
            "stored_bytes": st,
        }
        for p, sc, st in zip(ref.passages, scores, stored)
    ]
    return row
