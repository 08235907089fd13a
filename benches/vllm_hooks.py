"""The vLLM hooks end to end on the reference model in vLLM's layout (tests/support/vllm_layout.py):
top-1 agreement and KL of teacher-forced decode steps against the exact model, the codec's
bytes, and the hooks' time (codec, host transfers) against the exact forward's, per hook
configuration, all measured in one run on this machine's CPU.

    python benches/vllm_hooks.py [--calibration DIR] [--out reports/vllm_hooks.json]

``--out X.json`` also writes the table to ``X.txt`` under the command that made it.

Each passage is a batch of two sequences prefilled in one forward (as vLLM schedules them),
then decoded together for --decode steps. Generated tokens are not coded (as in
``kakeyaturbo eval``), so every scored step reads a coded prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_layout import Engine, LlamaForCausalLM  # noqa: E402

from kakeyaturbo.capture import read_tokens  # noqa: E402
from kakeyaturbo.modeling import load_model, resolve_model_dir  # noqa: E402
from kakeyaturbo.vllm import VLLMHookConfig, install_hooks  # noqa: E402


def run(model, seqs, prompt, decode):
    engine = Engine(model)
    t0 = time.perf_counter()
    engine.step([(i, s[:prompt]) for i, s in enumerate(seqs)])
    out = []
    for t in range(decode):
        out.append(torch.cat(engine.step([(i, [s[prompt + t]]) for i, s in enumerate(seqs)])))
    return torch.stack(out, 1), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=str(REPO.parent / "shared/models/kt-ref-a"),
        help="Llama Hugging Face folder, or a GGUF file (or a folder holding one)",
    )
    ap.add_argument("--text", default=str(REPO.parent / "shared/data/wikitext-2-raw-test.txt"))
    ap.add_argument("--calibration", help="calibration bundle: adds calibrated configs")
    ap.add_argument("--passages", type=int, default=4, help="batches of two sequences")
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # torch's spinning OpenMP workers slow the codec's threads

    model_dir = resolve_model_dir(args.model)
    model = LlamaForCausalLM(model_dir)
    _, tok = load_model(model_dir)
    need = args.prompt + args.decode
    batches = [
        [
            read_tokens(tok, args.text, need, offset_chars=40_000 * (2 * p + j) + 5_000)
            for j in range(2)
        ]
        for p in range(args.passages)
    ]
    configs = {
        "snapshot/pre-rope": VLLMHookConfig(mode="snapshot"),
        "snapshot/post-rope": VLLMHookConfig(mode="snapshot", hook="post-rope"),
        "in-forward/pre-rope": VLLMHookConfig(mode="in-forward"),
        "in-forward/post-rope": VLLMHookConfig(mode="in-forward", hook="post-rope"),
    }
    if args.calibration:
        configs["snapshot/pre-rope+calibration"] = VLLMHookConfig(calibration=args.calibration)
        configs["in-forward/pre-rope+calibration"] = VLLMHookConfig(
            mode="in-forward", calibration=args.calibration
        )
    exact, exact_s = [], 0.0
    for seqs in tqdm(batches, desc="exact"):
        logits, s = run(model, seqs, args.prompt, args.decode)
        exact.append(logits)
        exact_s += s
    rows = []
    for name, cfg in tqdm(configs.items(), desc="configs"):
        hooks = install_hooks(model, cfg)
        top1 = kl = 0.0
        seconds = 0.0
        for ref, seqs in zip(exact, batches):
            logits, s = run(model, seqs, args.prompt, args.decode)
            seconds += s
            top1 += (ref.argmax(-1) == logits.argmax(-1)).float().mean().item()
            lp, lq = ref.log_softmax(-1), logits.log_softmax(-1)
            kl += (lp.exp() * (lp - lq)).sum(-1).mean().item()
        st = hooks.stats()
        hooks.remove()
        n = len(batches)
        rows.append(
            {
                "config": name,
                "top1": top1 / n,
                "kl": kl / n,
                "ratio_vs_bf16": st["ratio_vs_bf16"],
                "coded_tokens": st["coded_tokens"],
                "encoded_bytes": st["encoded_bytes"],
                "codec_seconds": st["codec_seconds"],
                "transfer_seconds": st["d2h_seconds"] + st["h2d_seconds"],
                "seconds": seconds,
                "slowdown_vs_exact": seconds / exact_s,
            }
        )
    lines = [
        f"{args.passages} passages x 2 sequences, {args.prompt}-token prompts prefilled in one "
        f"forward, {args.decode} teacher-forced decode steps; CPU, 1 torch thread",
        f"{'config':34} {'top1':>6} {'KL':>8} {'ratio':>6} {'codec s':>8} {'slowdown':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['config']:34} {r['top1']:6.3f} {r['kl']:8.5f} {r['ratio_vs_bf16']:6.2f} "
            f"{r['codec_seconds']:8.2f} {r['slowdown_vs_exact']:7.2f}x"
        )
    print("\n".join(lines))
    if args.out:
        cmd = "python benches/vllm_hooks.py " + " ".join(argv if argv is not None else sys.argv[1:])
        txt = Path(args.out).with_suffix(".txt")
        txt.write_text(f"# Output of: {cmd.strip()}\n\n" + "\n".join(lines) + "\n")
        meta = {
            "command": cmd.strip(),
            "passages": args.passages,
            "prompt": args.prompt,
            "decode": args.decode,
            "sequences_per_passage": 2,
            "exact_seconds": exact_s,
            "device": "cpu",
            "torch_threads": 1,
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
