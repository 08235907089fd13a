"""SmolLM2's KV of real prompts through LMCache's own L2 adapters (file system and a Redis
server started here) with the ``kakeya`` serde and LMCache's ``fp8``, loaded back, and the
continuation teacher-forced on the loaded KV: KL / top-1 / delta-ppl against the exact KV,
bytes counted on the store. Writes reports/lmcache_quality.json.

    python benches/lmcache_quality.py --bundle DIR [--prompts 4 --prefix 1024 --cont 256 --bits B]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))

from lmcache_harness import RedisServer, Tier, chunk_keys, dir_bytes, redis_binary, split_chunks  # noqa: E402

GGUF = REPO.parent / "shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = REPO.parent / "shared/data/wikitext-2-raw-test.txt"


def prompt_kv(model, ids: torch.Tensor) -> torch.Tensor:
    """The prefix's KV in LMCache's layout ``[2, L, T, H*D]`` bf16 (keys post-RoPE)."""
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    ks, vs = [], []
    for layer in cache.layers:
        for t, out in ((layer.keys, ks), (layer.values, vs)):
            b, h, n, d = t.shape
            out.append(t[0].permute(1, 0, 2).reshape(n, h * d))
    return torch.stack([torch.stack(ks), torch.stack(vs)]).bfloat16()


def continuation_logits(model, kv: torch.Tensor, heads: int, cont: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache()
    _, n_layers, t, hidden = kv.shape
    d = hidden // heads
    for layer in range(n_layers):
        k = kv[0, layer].float().reshape(t, heads, d).permute(1, 0, 2)[None]
        v = kv[1, layer].float().reshape(t, heads, d).permute(1, 0, 2)[None]
        cache.update(k, v, layer)
    with torch.no_grad():
        return model(cont, past_key_values=cache, use_cache=True).logits[0].float()


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    nll_r = float(-lp[:-1].gather(-1, targets[1:, None]).mean())
    nll_g = float(-lq[:-1].gather(-1, targets[1:, None]).mean())
    return {
        "kl": kl,
        "top1": top1,
        "ppl_exact": math.exp(nll_r),
        "ppl": math.exp(nll_g),
        "delta_ppl": math.exp(nll_g) / math.exp(nll_r) - 1,
    }


def run_tier(name, spec, store_bytes, chunks_by_prompt):
    tier = Tier(spec)
    loaded = []
    try:
        for p, chunks in enumerate(chunks_by_prompt):
            keys = chunk_keys(len(chunks), salt=f"{name}{p}-".encode())
            for k, c in zip(keys, chunks):
                tier.store({k: c})
            got = [tier.load([k], c.shape, c.dtype)[0] for k, c in zip(keys, chunks)]
            if any(g is None for g in got):
                raise RuntimeError(f"{name}: a chunk missed on load")
            loaded.append(torch.cat(got, dim=2))
        return loaded, store_bytes()
    finally:
        tier.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--bits", type=float, default=None, help="the serde's bits (default its own)")
    ap.add_argument("--out", default=str(REPO / "reports" / "lmcache_quality.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    from kakeyaturbo.modeling import load_model, read_text, tokenize_text

    model, tok = load_model(GGUF)
    cfg = model.config
    heads, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = tokenize_text(tok, read_text(TEXT))[None]
    need = a.prefix + a.cont
    starts = [i * (len(ids[0]) // a.prompts) for i in range(a.prompts)]
    prompts = [ids[:, s : s + need] for s in starts]
    exact = [prompt_kv(model, p[:, : a.prefix]) for p in prompts]
    chunks_by_prompt = [split_chunks(kv, a.chunk) for kv in exact]
    kakeya = {
        "type": "kakeya",
        "bundle": a.bundle,
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": heads,
        "head_dim": hd,
        "rope_theta": float(cfg.rope_parameters["rope_theta"])
        if hasattr(cfg, "rope_parameters")
        else float(cfg.rope_theta),
        "chunk_size": a.chunk,
        "max_positions": int(cfg.max_position_embeddings),
    }
    if a.bits is not None:
        kakeya["bits"] = a.bits
    results = {}
    bf16 = sum(kv.numel() * 2 for kv in exact)
    binary = redis_binary()
    for serde_name, serde in (("kakeya", kakeya), ("fp8", {"type": "fp8"})):
        with tempfile.TemporaryDirectory() as d:
            spec = {"type": "fs", "base_path": d, "serde": serde}
            tiers = [("fs", spec, lambda d=d: dir_bytes(Path(d)))]
            if binary:
                server = RedisServer(binary).__enter__()
                spec_r = {"type": "resp", "host": "127.0.0.1", "port": server.port, "serde": serde}
                tiers.append(("redis", spec_r, server.value_bytes))
            try:
                for tier_name, sp, counter in tiers:
                    loaded, stored = run_tier(
                        f"{serde_name}-{tier_name}", sp, counter, chunks_by_prompt
                    )
                    metrics = []
                    for i, (p, kv) in enumerate(zip(prompts, loaded)):
                        cont = p[:, a.prefix :]
                        ref = continuation_logits(model, exact[i], heads, cont)
                        got = continuation_logits(model, kv, heads, cont)
                        metrics.append(compare(ref, got, cont[0]))
                    agg = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
                    results[f"{serde_name}/{tier_name}"] = {
                        **agg,
                        "store_bytes": stored,
                        "bf16_bytes": bf16,
                        "ratio": bf16 / stored,
                        "per_prompt": metrics,
                    }
                    print(
                        serde_name,
                        tier_name,
                        json.dumps({k: round(v, 5) for k, v in agg.items()}),
                        "ratio",
                        round(bf16 / stored, 3),
                        flush=True,
                    )
            finally:
                if binary:
                    server.__exit__()
    report = {
        "command": shlex.join(["python", "benches/lmcache_quality.py", *sys.argv[1:]]),
        "model": str(GGUF.name),
        "prompts": a.prompts,
        "prefix": a.prefix,
        "cont": a.cont,
        "chunk": a.chunk,
        "serde_kwargs": kakeya,
        "redis": binary,
        "results": results,
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
