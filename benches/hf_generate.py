"""Generation speed and KV-cache bytes on a local HF model: DynamicCache vs KakeyaCache vs
transformers' QuantizedCache, at several context lengths, measured in one run.

    .venv/bin/python benches/hf_generate.py                      # kt-ref-a, 1k and 4k context
    .venv/bin/python benches/hf_generate.py --model PATH --contexts 1024 4032 --new-tokens 64

For each context length every method prefills the same WikiText-2 tokens and greedily
generates `--new-tokens` tokens with `model.generate`. A logits processor timestamps each
step, so prefill time and decode tokens/s come from the same call. With `--rounds N` the
methods run N times, in another order each round, and each ratio is the median over rounds of
the ratio within a round (on a shared 2-core VM one call's speed moves by 10-20% against the
next's).

Every other method is made to follow DynamicCache's greedy tokens (a second processor forces
them after the first has recorded the method's own logits), so `top1` (its argmax equals
DynamicCache's) and `KL` (to DynamicCache's next-token distribution) are teacher-forced quality
over the generated continuation, measured in the timed call itself. KV bytes are measured after
generation by walking the tensors (and encoded blocks) each cache holds.

KakeyaCache variants (the design choice, see kakeyaturbo/hf/layer.py):
- `kakeya` (decoded_cache_bytes=0, the default): holds only compressed blocks, the exact hot
  window and the sinks; the model attends over the codes (kakeyaturbo/hf/coded_attention.py):
  each step decodes a layer's blocks to frame coordinates, keys go through the frame and RoPE,
  values stay in the frame (applied once per query), nothing decoded is kept.
- `kakeya(decode-all)` (`--decode-all`, coded_attention=False): every step decodes every block
  into dense keys and values for sdpa (QuantizedCache dequantises everything every step too).
- `kakeya+budget=Fxdense`: an explicit decoded-cache budget of F x DynamicCache's bytes. A layer
  whose whole decoded copy fits keeps one contiguous decoded buffer: each block is decoded once,
  the step after it is compressed, new tokens are written in place and attention gets views, so
  a step costs neither a decode nor the O(L) copy DynamicCache's torch.cat makes. Layers that do
  not fit keep single decoded blocks while the budget lasts and decode the rest every step.
  Everything kept counts in the KV bytes shown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".." / "shared" / "models" / "kt-ref-a"
DEFAULT_TEXT = ROOT / ".." / "shared" / "data" / "wikitext-2-raw-test.txt"
# optimum-quanto JIT-builds its CPU kernels with ninja, which pip puts next to the interpreter.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor, looking inside wrapper subclasses (quanto's QTensors)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.untyped_storage().nbytes()


def held_bytes(obj) -> int:
    """Bytes held by a cache: tensor storages (deduplicated) + kakeyaturbo encoded blocks."""
    import kakeyaturbo as kt

    seen, storages, total = set(), {}, 0

    def walk(x):
        nonlocal total
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
                total += tensor_bytes(x)
            else:
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, kt.EncodedLayer):
            total += x.nbytes
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif type(x).__name__ in ("KVTransforms", "Calibration"):
            return  # a calibration bundle is per model, like the weights: not cache bytes
        elif type(x).__module__.startswith(("kakeyaturbo.", "transformers.cache_utils")):
            fields = getattr(x, "__dict__", None)
            if fields is None and hasattr(x, "__slots__"):
                fields = {n: getattr(x, n, None) for n in x.__slots__}
            for y in (fields or {}).values():
                walk(y)

    walk(obj)
    return total + sum(storages.values())


class StepClock:
    """Logits processor that records when each step's logits arrive, and their log-probs."""

    def __init__(self):
        self.stamps: list[float] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:  # the step's kernels are queued, not done, until a sync
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        self.logprobs.append(scores[0].float().log_softmax(-1))
        return scores


class Follow:
    """Logits processor that forces the reference continuation (teacher forcing in generate)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.step = 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[self.step]] = 0.0
        self.step += 1
        return forced


def quantized_backend(model, ids) -> tuple[str | None, str]:
    """The first transformers QuantizedCache backend that works here, or (None, why not)."""
    from transformers import QuantizedCache

    from kakeyaturbo.hf import CACHE_ARG

    errors = []
    for backend in ("quanto", "hqq"):
        try:
            cache = QuantizedCache(backend=backend, config=model.config, nbits=4)
            with torch.inference_mode():
                model.generate(ids[:, :40], **{CACHE_ARG: cache}, max_new_tokens=2, do_sample=False)
            return backend, ""
        except Exception as exc:  # noqa: BLE001 - report any backend failure and move on
            errors.append(f"{backend}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return None, "; ".join(errors)


def run(model, ids, make_cache, new_tokens: int, follow: torch.Tensor | None = None):
    from transformers import LogitsProcessorList

    from kakeyaturbo.hf import CACHE_ARG

    cache = make_cache()
    clock = StepClock()
    base = peak_rss_bytes() if reset_peak_rss() else 0
    procs = [clock] + ([Follow(follow)] if follow is not None else [])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            **{CACHE_ARG: cache},
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList(procs),
        )
    prefill = clock.stamps[0] - start
    decode_tps = (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0])
    peak = peak_rss_bytes() - base if base else 0
    lp = torch.stack(clock.logprobs)
    return out[0, ids.shape[1] :], lp, prefill, decode_tps, held_bytes(cache), cache, peak


def rotations(methods: list, rounds: int) -> list:
    """`methods` once per round: round `r` starts `r` methods later and runs backwards when `r`
    is odd (round 0 is the given order, so DynamicCache, the reference, runs first). A method
    then follows different ones from round to round (a rotation alone keeps each after the
    same one), and a shared machine's drift from one call to the next falls on each in turn."""
    n, order = len(methods), []
    for r in range(rounds):
        turn = [methods[(r + i) % n] for i in range(n)]
        order += turn[::-1] if r % 2 else turn
    return order


def per_round(tps: list, base: list) -> list:
    """Each round's speed ratio: `tps[r] / base[r]`, both timed in round `r`."""
    return [t / b for t, b in zip(tps, base)]


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark of this process (Linux); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM of this process (0 where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || got)) of two [steps, vocab] log-prob tensors."""
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    # Tokens both runs rule out (-inf, e.g. EOS before min_new_tokens) contribute 0, not NaN.
    kl = (ref.exp() * (ref - got)).nan_to_num(0.0).sum(-1).clamp_min(0).mean().item()
    return top1, kl


def kakeya_options(model, calibration: Path | None, hot_dtype: str) -> dict:
    """KakeyaCache options from the command line: the bundle (read once, checked against this
    model; None: none) and the hot window's dtype ("model": the model's)."""
    options: dict = {"calibration": None}
    if calibration is not None:
        from kakeyaturbo.calibration import Calibration

        options["calibration"] = Calibration.load(calibration, model)
    if hot_dtype != "model":
        options["hot_dtype"] = getattr(torch, hot_dtype)
    return options


def kakeya_factory(model, budget_bytes: int, coded: bool, options: dict):
    from dataclasses import replace

    from kakeyaturbo.hf import KakeyaCache, KakeyaOptions

    speed = replace(options.get("options", KakeyaOptions()), decoded_cache_bytes=budget_bytes)
    kwargs = {**options, "options": speed}

    def make():
        return KakeyaCache.from_model(model, coded_attention=coded, **kwargs)

    return make


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="Hugging Face model folder, or a GGUF file (or a folder holding one)",
    )
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4032])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--calibration",
        type=Path,
        help="calibration bundle for KakeyaCache (default: none, the self-calibrated recipe)",
    )
    ap.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0, 0.5, float("inf")],
        help="KakeyaCache decoded-block budgets as fractions of DynamicCache's KV bytes (0: none)",
    )
    ap.add_argument(
        "--decode-all",
        action="store_true",
        help="also time KakeyaCache with coded_attention=False (every step decodes every "
        "block into dense K/V for sdpa), the design before attention over the codes",
    )
    ap.add_argument(
        "--hot-dtype",
        choices=["model", "bfloat16", "float16"],
        default="model",
        help="dtype of KakeyaCache's exact tokens (hot window, sinks); bfloat16 on a float32 "
        "model holds what a bfloat16 deployment holds (default: the model's)",
    )
    ap.add_argument(
        "--int8-hot-values",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="KakeyaCache's int8_hot_values: its hot window's values as int8 rows (default: "
        "the cache's default, on)",
    )
    ap.add_argument(
        "--attention-precision",
        choices=["bfloat16", "float32", "int16"],
        help="KakeyaCache's attention_precision: the key frame product's arithmetic on the CPU "
        "(default: the cache's default; int16 and bfloat16 where the CPU multiplies them "
        "natively, float32 elsewhere)",
    )
    ap.add_argument("--residual-length", type=int, help="KakeyaCache's hot window (default: its)")
    ap.add_argument(
        "--block-size", type=int, help="KakeyaCache's block size (default: the recipe's)"
    )
    ap.add_argument(
        "--post-rope",
        action="store_true",
        help="KakeyaCache codes keys after RoPE (pre_rope=False; no bundle): attention over "
        "the codes then scores keys in their frame, without the per-token frame product",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the model runs (cuda: KakeyaCache's codec encodes on the CPU; attention "
        "decodes the blocks on the GPU from copies held there, device_decode.py)",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a small shared box OpenMP spin-waits against the "
        "codec's worker threads and multi-threaded timings mean little; 0 = torch's default)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times each context's methods run, in another order each round (DynamicCache "
        "first in the first); speeds are the medians over rounds, each ratio the median of "
        "the ratios within a round, so a shared machine's drift between one call and the next "
        "falls on every method in turn (default 1)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    from transformers import DynamicCache, QuantizedCache

    import kakeyaturbo as kt
    from kakeyaturbo.hf import KakeyaCache, KakeyaOptions
    from kakeyaturbo.modeling import kv_geometry, load_model
    from kakeyaturbo.recipes import default_recipe

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    model.to(args.device)
    need = max(args.contexts)
    text = args.text.read_text(encoding="utf-8")
    all_ids = tok(text[: 8 * need], return_tensors="pt").input_ids.to(args.device)
    if all_ids.shape[1] < need:
        raise SystemExit(f"{args.text} gives only {all_ids.shape[1]} tokens; need {need}")
    backend, why = quantized_backend(model, all_ids)
    options = kakeya_options(model, args.calibration, args.hot_dtype)
    calibration = options["calibration"]
    if args.block_size is not None:
        options["recipe"] = default_recipe(calibration, block_size=args.block_size)
    if args.residual_length is not None:
        options["residual_length"] = args.residual_length
    if args.int8_hot_values is not None:
        options["int8_hot_values"] = args.int8_hot_values
    if args.attention_precision is not None:
        options["options"] = KakeyaOptions(attention_precision=args.attention_precision)
    if args.post_rope:
        options["pre_rope"] = False
    probe = KakeyaCache(model.config, **options)  # what the caches use
    recipe = probe.recipe
    # Ratios are against bf16 KV bytes whatever the model's dtype (a float32 model's
    # DynamicCache holds twice that).
    to_bf16 = 16 / torch.finfo(model.dtype).bits

    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "CPU"
    print(
        f"model {args.model.name} ({model.dtype}) on {where}, torch threads {threads}, "
        f"kakeyaturbo {kt.__version__}"
    )
    print(f"kakeya recipe: K {recipe.k.to_dict()}\n               V {recipe.v.to_dict()}")
    hot = args.hot_dtype if args.hot_dtype != "model" else f"the model's ({model.dtype})"
    if probe.int8_hot_values:
        hot += ", values as int8 rows"
    print(f"kakeya hot window: {probe.residual_length} tokens and more, held in {hot}")
    hd = kv_geometry(model.config).head_dim
    native = {"int16": kt.codec.int16_products(hd), "bfloat16": kt.codec.bf16_products(hd)}
    print(
        f"kakeya attention precision: {probe.attention_precision} (native products on this "
        "CPU: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in native.items()) + ")"
    )
    qdesc = f"backend {backend}, 4-bit, residual 128" if backend else "UNAVAILABLE: " + why
    print(f"quantized cache: {qdesc}")

    rows = []
    for ctx in args.contexts:
        ids = all_ids[:, :ctx]
        methods = [("DynamicCache", lambda: DynamicCache(config=model.config))]
        if backend:
            methods.append(
                (
                    f"QuantizedCache({backend},4b)",
                    lambda: QuantizedCache(backend=backend, config=model.config, nbits=4),
                )
            )
        methods += [
            ("kakeya" if f == 0 else f"kakeya+budget={f:g}xdense", (f, True)) for f in args.budgets
        ]
        if args.decode_all:
            methods.append(("kakeya(decode-all)", (0, False)))
        ref = ref_lp = dense = None
        seen: dict[str, dict] = {}  # per method: its first round's figures, every round's speeds
        for i, (name, make) in enumerate(rotations(methods, args.rounds)):
            rnd = i // len(methods)
            if callable(make):
                # Peers run on sdpa (a KakeyaCache switches the model to "kakeya" attention).
                model.set_attn_implementation("sdpa")
            else:  # a decoded budget, as a fraction of DynamicCache's bytes here
                frac, coded = make
                budget = (
                    0 if frac == 0 else (1 << 40 if frac == float("inf") else int(frac * dense))
                )
                make = kakeya_factory(model, budget, coded, options)
            # Warm-up (quanto JIT, allocator), once per method and context: later rounds follow
            # the first's. On a GPU, the timed call itself: on an H100 (torch 2.11, bfloat16) a
            # process's first decode over a set of key lengths took ~8x the time of the second
            # (6 ms per sdpa call, reports/gpu_h100.txt), so the timed call measures a server
            # that has seen these lengths.
            if name not in seen:
                if ids.is_cuda:
                    run(model, ids, make, args.new_tokens, ref)
                else:
                    run(model, ids[:, :64], make, 2)
            gen, lp, prefill, tps, nbytes, cache, peak = run(model, ids, make, args.new_tokens, ref)
            if ref is None:
                ref, ref_lp, dense = gen, lp, nbytes
            if name not in seen:
                top1, kl = agreement(ref_lp, lp)
                note = ""
                if isinstance(cache, KakeyaCache):
                    rep = cache.memory_report()
                    assert rep["total_bytes"] == nbytes, (rep["total_bytes"], nbytes)
                    note = f"decoded {rep['decoded_cache_bytes'] / 2**20:.2f} MiB"
                seen[name] = dict(
                    nbytes=nbytes, top1=top1, kl=kl, peak=peak, note=note, tps=[], prefill=[]
                )
            seen[name]["tps"].append(tps)
            seen[name]["prefill"].append(prefill)
            print(f"  ctx {ctx:5d} {name:28s} round {rnd + 1} done", flush=True)
        dyn = seen["DynamicCache"]
        for name, _ in methods:
            m = seen[name]
            m.update(ratios=per_round(m["tps"], dyn["tps"]), vs_bf16=dense * to_bf16 / m["nbytes"])
            rows.append((ctx, name, m))

    print()
    head = (
        f"{'ctx':>5} {'method':28s} {'prefill s':>9} {'decode tok/s':>12} {'vs dyn':>7} "
        f"{'KV MiB':>8} {'vs bf16':>8} {'top1':>6} {'KL':>8} {'peak MiB':>8}  note"
    )
    print(head)
    print("-" * len(head))
    for ctx, name, m in rows:
        print(
            f"{ctx:5d} {name:28s} {median(m['prefill']):9.3f} {median(m['tps']):12.1f} "
            f"{median(m['ratios']):7.2f} {m['nbytes'] / 2**20:8.2f} {m['vs_bf16']:8.2f} "
            f"{m['top1']:6.3f} {m['kl']:8.2e} {m['peak'] / 2**20:8.1f}  {m['note']}"
        )
    print(
        "\nvs bf16 = DynamicCache's KV bytes in bf16 / method bytes (same tokens); "
        "vs dyn = decode tok/s / DynamicCache's; top1, KL: teacher-forced on DynamicCache's "
        "greedy continuation, against its logits; peak MiB: rise of the process's peak RSS "
        "during the call (prefill activations included), in this process after the methods "
        "before it (benches/peak_memory.py measures each in a fresh process)."
    )
    if args.rounds > 1:
        print(
            f"\n{args.rounds} rounds, methods in another order each round: prefill s and decode "
            "tok/s are medians over rounds, vs dyn the median of the ratios within each round; "
            "top1, KL, bytes and peak from the first round. Each round's ratio:"
        )
        for r in rows:
            if r[1] != "DynamicCache":
                each = " ".join(f"{x:.2f}" for x in r[2]["ratios"])
                print(f"ctx {r[0]}: {r[1]}: vs DynamicCache {each}")
    for ctx in args.contexts:
        q = next((r for r in rows if r[0] == ctx and r[1].startswith("QuantizedCache")), None)
        if q is None:
            continue
        for r in (r for r in rows if r[0] == ctx and r[1].startswith("kakeya")):
            each = per_round(r[2]["tps"], q[2]["tps"])
            rounds = f" (each round: {' '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""
            print(
                f"ctx {ctx}: {r[1]}: {median(each):.2f}x QuantizedCache's decode tok/s{rounds}, "
                f"{r[2]['vs_bf16']:.2f}x fewer bytes than bf16 vs its {q[2]['vs_bf16']:.2f}x"
            )


if __name__ == "__main__":
    main()
