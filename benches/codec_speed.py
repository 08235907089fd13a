"""Codec throughput: the Rust core vs the numpy reference vs a plain memory copy.

Throughput is MB (1e6 bytes) of float32 input per second, best of ``--repeats`` runs, for
head_dim 64 and 128, block 512, bit widths 2/3/4 (k=16, metric mse, other defaults):

* ``rust batch``  ``kt.encode_batch`` / ``kt.decode_batch`` on ``[streams, tokens, D]``
  (streams in parallel on all cores, GIL released);
* ``rust 1x``     ``kt.encode_layer`` / ``kt.decode_layer`` on one ``[tokens, D]`` stream;
* ``numpy ref``   ``tests/support/numpy_reference.py`` on one ``[tokens, D]`` stream (a testing and
  benchmarking reference, not a product path), one BLAS thread unless
  ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` say otherwise;
* ``memcpy``      ``np.copy`` of the whole ``[streams, tokens, D]`` array: the ceiling.

    python benches/codec_speed.py [--tokens 4096] [--streams 8] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import os

# The reference's matrices are small (512 x D): BLAS threads gain nothing there, and
# OpenBLAS's spinning workers made its timings erratic (5-50x slower) on a busy machine.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kakeyaturbo as kt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import numpy_reference as ref  # noqa: E402

HEAD_DIMS = (64, 128)
BITS = (2, 3, 4)
BLOCK = 512


def kv_like(streams: int, tokens: int, d: int, seed: int = 0) -> np.ndarray:
    """Synthetic KV-cache-like data: decaying spectrum in a random frame per stream, a
    non-zero mean, a few large channels and periodic high-norm "sink" tokens."""
    rng = np.random.default_rng(seed)
    out = np.empty((streams, tokens, d), np.float32)
    scale = 4.0 / (1.0 + np.arange(d)) ** 0.7
    for s in range(streams):
        frame = np.linalg.qr(rng.standard_normal((d, d)))[0]
        x = (rng.standard_normal((tokens, d)) * scale) @ frame.T + 1.5
        x[:, :3] *= 6.0
        x[::97] *= 5.0
        out[s] = x
    return out


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Minimum wall time over ``repeats`` calls, and the last call's result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def encode_decode(bar, label: str, encode, args: tuple, decode, mb: float, repeats: int):
    """``(encode MB/s, decode MB/s, encoding, decoded)`` of ``decode(encode(*args))``, each the
    best of ``repeats`` calls; one progress step each."""
    bar.set_postfix_str(label)
    t_enc, enc = best_time(lambda: encode(*args), repeats)
    bar.update(1)
    t_dec, y = best_time(lambda: decode(enc), repeats)
    bar.update(1)
    return mb / t_enc, mb / t_dec, enc, y


def rel_err(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def run(tokens: int, streams: int, repeats: int) -> list[dict]:
    for b in BITS:  # fill the codebook cache and start the thread pool outside the timings
        kt.decode_layer(kt.encode_layer(np.ones((4, 8), np.float32), kt.CodecParams(bit_width=b)))
    rows = []
    configs = [(d, b) for d in HEAD_DIMS for b in BITS]
    bar = tqdm(total=len(configs) * 7, desc="codec speed", unit="step")
    for d in HEAD_DIMS:
        x3 = kv_like(streams, tokens, d)
        x1 = np.ascontiguousarray(x3[0])
        mb3, mb1 = x3.nbytes / 1e6, x1.nbytes / 1e6
        bar.set_postfix_str(f"D={d} memcpy")
        t_copy, _ = best_time(lambda x3=x3: np.copy(x3), max(repeats, 5))
        for b in BITS:
            p = kt.CodecParams(block_size=BLOCK, bit_width=b, k=16)
            row: dict = {"head_dim": d, "bit_width": b, "memcpy": mb3 / t_copy}
            bar.update(1)

            at = f"D={d} b={b}"
            row["rust_batch_enc"], row["rust_batch_dec"], encs, y3 = encode_decode(
                bar, f"{at} rust batch", kt.encode_batch, (x3, p), kt.decode_batch, mb3, repeats
            )
            row["rust_rel_err"] = rel_err(x3, y3)
            row["bits_per_value"] = 8 * sum(e.nbytes for e in encs) / x3.size
            row["rust_1x_enc"], row["rust_1x_dec"], _, _ = encode_decode(
                bar, f"{at} rust 1x", kt.encode_layer, (x1, p), kt.decode_layer, mb1, repeats
            )
            row["ref_enc"], row["ref_dec"], _, y1 = encode_decode(
                bar, f"{at} numpy ref", ref.encode_layer, (x1, p), ref.decode_layer, mb1, repeats
            )
            row["ref_rel_err"] = rel_err(x1, y1)
            rows.append(row)
    bar.close()
    return rows


def print_table(rows: list[dict], tokens: int, streams: int, repeats: int) -> None:
    print(
        f"\nMB/s of float32 input, best of {repeats}; batch = [{streams}, {tokens}, D], "
        f"1x and numpy ref = [{tokens}, D]; block {BLOCK}, k=16, mse; {os.cpu_count()} cores, "
        f"numpy BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS')}"
    )
    head = (
        f"{'D':>4} {'bits':>4} | {'batch enc':>9} {'batch dec':>9} | {'1x enc':>7} "
        f"{'1x dec':>7} | {'ref enc':>7} {'ref dec':>7} | {'memcpy':>7} | "
        f"{'enc b/ref':>9} {'dec b/ref':>9} {'enc 1x/ref':>10} | {'enc/cpy':>7} {'dec/cpy':>7}"
        f" | {'err rust':>8} {'err ref':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['head_dim']:>4} {r['bit_width']:>4} | {r['rust_batch_enc']:>9.1f} "
            f"{r['rust_batch_dec']:>9.1f} | {r['rust_1x_enc']:>7.1f} {r['rust_1x_dec']:>7.1f} | "
            f"{r['ref_enc']:>7.1f} {r['ref_dec']:>7.1f} | {r['memcpy']:>7.0f} | "
            f"{r['rust_batch_enc'] / r['ref_enc']:>8.1f}x "
            f"{r['rust_batch_dec'] / r['ref_dec']:>8.1f}x "
            f"{r['rust_1x_enc'] / r['ref_enc']:>9.1f}x | "
            f"{r['rust_batch_enc'] / r['memcpy']:>7.4f} {r['rust_batch_dec'] / r['memcpy']:>7.4f}"
            f" | {r['rust_rel_err']:>8.4f} {r['ref_rel_err']:>7.4f}"
        )
    print(
        "enc b/ref, dec b/ref: rust batch / numpy ref; enc 1x/ref: single-stream rust / numpy"
        " ref; enc/cpy, dec/cpy: rust batch / memcpy."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per stream")
    ap.add_argument("--streams", type=int, default=8, help="streams for the batch API")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.streams < 1 or args.repeats < 1:
        ap.error("--tokens, --streams and --repeats must be >= 1")
    t0 = time.perf_counter()
    rows = run(args.tokens, args.streams, args.repeats)
    print_table(rows, args.tokens, args.streams, args.repeats)
    elapsed = time.perf_counter() - t0
    print(f"total {elapsed:.1f} s")
    if args.json:
        meta = {
            "tokens": args.tokens,
            "streams": args.streams,
            "repeats": args.repeats,
            "block_size": BLOCK,
            "k": 16,
            "cpu_count": os.cpu_count(),
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
            "machine": platform.machine(),
            "numpy": np.__version__,
            "kakeyaturbo": kt.__version__,
            "elapsed_s": elapsed,
            "unit": "MB/s of float32 input (1e6 bytes)",
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
