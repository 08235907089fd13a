"""Serialize / deserialize throughput of the ``kakeya`` LMCache serde per 256-token chunk of
SmolLM2's real KV (MB/s of bf16 KV, 1 and 2 threads), beside LMCache's file-system adapter's
own write / read speed of the same chunks without a serde, in one run. Writes
reports/lmcache_throughput.json.

    python benches/lmcache_throughput.py --bundle DIR [--chunks 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO / "benches")]

from lmcache_harness import Tier, chunk_keys, split_chunks  # noqa: E402

from lmcache_quality import GGUF, TEXT, prompt_kv  # noqa: E402


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "reports" / "lmcache_throughput.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    from kakeyaturbo.lmcache.options import SerdeOptions
    from kakeyaturbo.lmcache.serde import build_codec
    from kakeyaturbo.modeling import load_model, read_text, tokenize_text

    model, tok = load_model(GGUF)
    ids = tokenize_text(tok, read_text(TEXT))[None]
    chunks = split_chunks(prompt_kv(model, ids[:, 2000 : 2000 + 256 * a.chunks]), 256)
    cfg = model.config
    kw = {
        "bundle": a.bundle,
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": 64,
        "rope_theta": 100000.0,
    }
    codec = build_codec(SerdeOptions.from_kwargs(kw))
    total = sum(c.numel() * 2 for c in chunks)
    rows = {}
    for threads in (1, 2):
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            blobs = list(pool.map(codec.encode, chunks))
            enc = time.perf_counter() - t
            outs = [torch.empty_like(c) for c in chunks]
            t = time.perf_counter()
            list(pool.map(lambda p: codec.decode(memoryview(p[0]), p[1]), zip(blobs, outs)))
            dec = time.perf_counter() - t
        rows[f"kakeya serialize, {threads} thread(s)"] = rate(total, enc)
        rows[f"kakeya deserialize, {threads} thread(s)"] = rate(total, dec)
    with tempfile.TemporaryDirectory() as d:
        tier = Tier({"type": "fs", "base_path": d})
        try:
            keys = chunk_keys(len(chunks), salt=b"raw")
            t = time.perf_counter()
            tier.store(dict(zip(keys, chunks)))
            w = time.perf_counter() - t
            t = time.perf_counter()
            tier.load(keys, chunks[0].shape, chunks[0].dtype)
            r = time.perf_counter() - t
        finally:
            tier.close()
    rows["fs adapter write (bf16, no serde)"] = rate(total, w)
    rows["fs adapter read (bf16, no serde)"] = rate(total, r)
    for k, v in rows.items():
        print(f"{k:40s} {v:10.1f} MB/s")
    Path(a.out).write_text(
        json.dumps({"chunks": len(chunks), "bf16_bytes": total, "mb_per_s": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
