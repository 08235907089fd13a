"""Command line: `kakeyaturbo eval {ppl,sweep,layers,bytes,all,held-out,methods}` and
`kakeyaturbo report`.

`register(subparsers)` adds both commands to the top-level `kakeyaturbo` parser;
`python -m kakeyaturbo.eval.cli ...` runs the same commands without it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from kakeyaturbo.cli import add_model_argument

#: The harness's protocols (``eval.harness.MODES``; named here so parsing imports no torch).
MODES = ("snapshot", "in-forward", "in-forward-hot")

__all__ = ["main", "register"]

DEFAULT_CTX, DEFAULT_N_EVAL, DEFAULT_PASSAGES = 960, 64, 16


def _command(args) -> str:
    argv = getattr(args, "_argv", None)
    if argv is None:
        argv = sys.argv[1:]
    return "kakeyaturbo " + shlex.join(argv)


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _add_data(p: argparse.ArgumentParser, passages: bool = True) -> None:
    add_model_argument(p)
    p.add_argument(
        "--text", required=True, help="evaluation text file (never the calibration text)"
    )
    if passages:
        p.add_argument(
            "--ctx",
            type=int,
            default=DEFAULT_CTX,
            help="prefix tokens compressed (default %(default)s)",
        )
        p.add_argument(
            "--n-eval",
            type=int,
            default=DEFAULT_N_EVAL,
            help="teacher-forced tokens scored on top (default %(default)s)",
        )
        p.add_argument(
            "--passages", type=int, default=DEFAULT_PASSAGES, help="passages (default %(default)s)"
        )
        p.add_argument(
            "--batch", type=int, default=16, help="passages per forward pass (default %(default)s)"
        )
        p.add_argument(
            "--copy",
            action="store_true",
            help="the copying test: each window written twice, scored on the second copy (a "
            "model that copies exactly shows every KV error in the first)",
        )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _setup(args):
    from kakeyaturbo.eval.ppl import load_setup

    return load_setup(
        args.model,
        args.text,
        args.ctx,
        args.n_eval,
        args.passages,
        args.batch,
        _progress(args),
        copy=getattr(args, "copy", False),
    )


def _shared_options(text: str | None) -> dict | None:
    """``sink_tokens=4,residual_length=32`` -> the shared options applied to every method."""
    if not text:
        return None
    from kakeyaturbo.eval.methods import COMMON_KEYS, parse_spec

    _, opts = parse_spec("options:" + text)
    unknown = sorted(set(opts) - set(COMMON_KEYS))
    if unknown:
        raise SystemExit(f"--options: {unknown} are not shared options {COMMON_KEYS}")
    return opts


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def cmd_ppl(args) -> int:
    from kakeyaturbo.eval.ppl import ppl_result, write_json

    setup = _setup(args)
    res = ppl_result(setup, args.method, args.mode, args.streams, _command(args), _progress(args))
    write_json(res, args.out)
    for r in res["methods"]:
        if r.get("skipped") or r.get("error"):
            what = "skipped" if r.get("skipped") else "ERROR"
            _say(f"{r['method']:40s} {what}: {r.get('skipped') or r.get('error')}")
        else:
            _say(
                f"{r['method']:40s} ratio {r['ratio']:6.2f}x  dppl {100 * r['delta_ppl']:+7.3f}%  "
                f"KL {r['kl']:.2e}  top1 {100 * r['top1']:5.1f}%  {r['verdict']}"
            )
    _say(f"wrote {args.out}")
    return 1 if any(r.get("error") for r in res["methods"]) else 0


def cmd_sweep(args) -> int:
    from kakeyaturbo.eval.ppl import environment, run_methods, write_json
    from kakeyaturbo.eval.sweep import DEFAULT_FAMILIES, expand, plot_pareto, sweep_table

    t0 = time.perf_counter()
    setup = _setup(args)
    args.family = args.family or list(DEFAULT_FAMILIES)
    specs = expand(args.family, args.bits)
    shared = _shared_options(args.options)
    rows = run_methods(setup, specs, args.mode, shared, _progress(args), label="sweep")
    plot = args.plot or str(Path(args.out).with_suffix(".png"))
    res = {
        "kind": "sweep",
        "command": _command(args),
        **setup.config(),
        "mode": args.mode,
        "options": shared or {},
        "families": args.family,
        "bits": args.bits,
        "ppl_ref": next((r["ppl_ref"] for r in rows if r.get("ppl_ref") is not None), None),
        "table": sweep_table(rows),
        "plot": plot,
        "methods": rows,
        "seconds": round(time.perf_counter() - t0, 1),
        "environment": environment(),
    }
    if getattr(args, "_all_command", None):
        res["all_command"] = args._all_command
    title = (
        f"{Path(args.model).name} on {Path(args.text).name}: ctx {args.ctx}, "
        f"{args.n_eval} scored tokens, "
        f"{args.passages} passages, {args.mode}" + (f", {args.options}" if args.options else "")
    )
    Path(plot).parent.mkdir(parents=True, exist_ok=True)
    plot_pareto(rows, args.family, plot, title)
    write_json(res, args.out)
    for e in res["table"]:
        if e.get("note"):
            _say(f"{e['method']:34s} not run: {e['note']}")
        else:
            _say(
                f"{e['method']:34s} ratio {e['ratio']:6.2f}x  "
                f"dppl {100 * e['delta_ppl']:+7.3f}%  KL {e['kl']:.2e}  "
                f"top1 {100 * e['top1']:5.1f}%  {e['verdict']:8s} {'PARETO' if e['pareto'] else ''}"
            )
    _say(f"wrote {args.out} and {plot}")
    return 1 if any(r.get("error") for r in rows) else 0


def cmd_layers(args) -> int:
    from kakeyaturbo.eval.diagnostics import layer_diagnostics
    from kakeyaturbo.eval.ppl import write_json

    setup = _setup(args)
    sections = [
        layer_diagnostics(setup, spec, _progress(args)) for spec in args.method or ["kakeya"]
    ]
    out = Path(args.out)
    for i, sec in enumerate(sections):
        path = out if len(sections) == 1 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        write_json(
            {"kind": "layers", "command": _command(args), **setup.config(), "mode": "mixed", **sec},
            path,
        )
        _say(f"wrote {path}")
    return 0


def cmd_bytes(args) -> int:
    from kakeyaturbo.eval.bytes_report import bytes_result
    from kakeyaturbo.eval.ppl import write_json
    from kakeyaturbo.modeling import load_model, read_text, tokenize_text

    model, tok = load_model(args.model)
    ids = tokenize_text(tok, read_text(args.text))
    res = bytes_result(
        model,
        ids,
        args.method or ["kakeya"],
        args.contexts,
        args.fit_max,
        args.project,
        _command(args),
        _progress(args),
    )
    res.update(model=args.model, text=args.text)
    write_json(res, args.out)
    for m in res["methods"]:
        if m.get("skipped") or m.get("error"):
            _say(f"{m['method']:30s} {m.get('skipped') or m.get('error')}")
            continue
        val = ", ".join(f"{v['rel_error']:+.4%} @{v['tokens']}" for v in m["validation"])
        proj = ", ".join(f"{p['tokens'] // 1024}k {p['ratio']:.2f}x" for p in m["projection"])
        _say(f"{m['method']:30s} projection {proj}; check vs measured {val}")
    _say(f"wrote {args.out}")
    return 1 if any(m.get("error") for m in res["methods"]) else 0


def cmd_report(args) -> int:
    from kakeyaturbo.eval.report import write_report

    path = write_report(args.results, args.out, getattr(args, "all_command", None))
    _say(f"wrote {path}")
    return 0


DEFAULT_LAYER_METHODS = ["kakeya"]
DEFAULT_BYTES_METHODS = [
    "kakeya",
    "kakeya:bits_per_value=3",
    "kivi:bits=2",
    "kivi:bits=2,skip_layers=0",
    "turboquant:bits=3",
    "fp8",
    "hf-quanto:bits=4",
]


def cmd_all(args) -> int:
    """Everything in `reports/`: sweep + plot, diagnostics, bytes, then the README."""
    from kakeyaturbo.eval.sweep import DEFAULT_BITS, DEFAULT_FAMILIES

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = ["--model", args.model, "--text", args.text]
    run = ["--ctx", str(args.ctx), "--n-eval", str(args.n_eval), "--passages", str(args.passages)]
    extra = ["--no-progress"] if args.no_progress else []
    steps = [
        [
            "eval",
            "sweep",
            *data,
            *run,
            *sum((["--family", f] for f in DEFAULT_FAMILIES), []),
            "--bits",
            *map(str, DEFAULT_BITS),
            "--out",
            str(out / "sweep.json"),
            "--plot",
            str(out / "pareto.png"),
        ],
        [
            "eval",
            "layers",
            *data,
            *run,
            *sum((["--method", m] for m in DEFAULT_LAYER_METHODS), []),
            "--out",
            str(out / "layers.json"),
        ],
        [
            "eval",
            "bytes",
            *data,
            *sum((["--method", m] for m in DEFAULT_BYTES_METHODS), []),
            "--out",
            str(out / "bytes.json"),
        ],
    ]
    if args.skip:
        steps = [s for s in steps if s[1] not in args.skip]
    parser = build_parser()
    all_command = _command(args)
    rc = 0
    t0 = time.perf_counter()
    for argv in steps:
        _say("== kakeyaturbo " + shlex.join(argv))
        step = parser.parse_args(argv + extra)
        step._argv = argv
        step._all_command = all_command
        rc |= step.func(step)
    from kakeyaturbo.eval.report import write_report

    path = write_report(out, all_command=all_command)
    _say(f"wrote {path} ({time.perf_counter() - t0:.0f} s in all)")
    return rc


def cmd_held_out(args) -> int:
    """A result's scores on the passages none of the chosen runs evaluated, and on the rest."""
    import json

    from kakeyaturbo.eval.held_out import format_held_out, held_out

    result = json.loads(Path(args.result).read_text())
    chosen = [json.loads(Path(c).read_text()) for c in args.chosen]
    rows = held_out(result, chosen)
    text = "$ " + _command(args) + "\n" + format_held_out(result, rows) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


def cmd_methods(args) -> int:
    from kakeyaturbo.eval.methods import COMMON_KEY_VALUES
    from kakeyaturbo.eval.registry import METHOD_HELP

    for name in sorted(METHOD_HELP):
        print(f"{name:12s} {METHOD_HELP[name]}")
    shared = " ".join(f"{key}={form}" for key, form in COMMON_KEY_VALUES.items())
    print(f"\nshared options: {shared}; a k_/v_ prefix applies a key to one stream")
    return 0


def register(subparsers) -> None:
    """Add `eval` (with its sub-commands) and `report` to a top-level argparse subparsers object."""
    from kakeyaturbo.eval.sweep import DEFAULT_BITS, DEFAULT_FAMILIES

    ev = subparsers.add_parser(
        "eval",
        help="quality and bytes of KV codecs against peers",
        description="Evaluate KV codecs: perplexity/KL/top-1 and stored bytes.",
    )
    sub = ev.add_subparsers(
        dest="eval_command", metavar="{ppl,sweep,layers,bytes,all,held-out,methods}"
    )
    sub.required = True

    p = sub.add_parser(
        "ppl", help="delta-ppl, KL, top-1 and bytes of methods against the uncompressed run"
    )
    _add_data(p)
    p.add_argument(
        "--method",
        action="append",
        required=True,
        help="method spec, repeatable: kakeya[:key=value,...], kivi:bits=2, ... "
        "(see `eval methods`)",
    )
    p.add_argument(
        "--mode",
        choices=list(MODES),
        default="snapshot",
        help="snapshot: compress the finished prefill; "
        "in-forward: every layer sees reconstructed K/V; "
        "in-forward-hot: as in-forward, but each query reads its newest 128 tokens exact "
        "(KakeyaCache's hot window while generating)",
    )
    p.add_argument(
        "--streams",
        choices=["kv", "k", "v"],
        default=None,
        help="compress only keys (k) or only values (v); default: the method's own",
    )
    p.add_argument("--out", default="results.json")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser(
        "sweep", help="method families x bit widths -> Pareto table (JSON) and plot (PNG)"
    )
    _add_data(p)
    p.add_argument(
        "--family",
        action="append",
        default=None,
        help="spec template with {bits}, or a fixed spec; repeatable (default: "
        + " ".join(DEFAULT_FAMILIES)
        + ")",
    )
    p.add_argument("--bits", type=int, nargs="+", default=DEFAULT_BITS)
    p.add_argument("--mode", choices=list(MODES), default="snapshot")
    p.add_argument(
        "--options",
        default=None,
        help="shared options for every method alike, e.g. sink_tokens=4,residual_length=32 "
        "(the protocol the product ships)",
    )
    p.add_argument("--out", default="reports/sweep.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "layers", help="per-layer sensitivity, depth compounding, K-only/V-only attribution"
    )
    _add_data(p)
    p.add_argument(
        "--method", action="append", default=None, help="method spec, repeatable (default: kakeya)"
    )
    p.add_argument("--out", default="reports/layers.json")
    p.set_defaults(func=cmd_layers)

    p = sub.add_parser(
        "bytes", help="per-layer bytes at several contexts and a projection to long contexts"
    )
    _add_data(p, passages=False)
    p.add_argument(
        "--method", action="append", default=None, help="method spec, repeatable (default: kakeya)"
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument(
        "--fit-max", type=int, default=1024, help="longest prefix used to fit unit costs"
    )
    p.add_argument("--project", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    p.add_argument("--out", default="reports/bytes.json")
    p.set_defaults(func=cmd_bytes)

    p = sub.add_parser("all", help="regenerate reports/: sweep + plot, diagnostics, bytes, README")
    _add_data(p)
    p.add_argument("--out-dir", default="reports")
    p.add_argument("--skip", nargs="*", choices=["sweep", "layers", "bytes"], default=[])
    p.set_defaults(func=cmd_all)

    p = sub.add_parser(
        "held-out",
        help="an eval ppl result re-scored on the passages that the runs a choice was made on "
        "did not evaluate",
    )
    p.add_argument("result", help="eval ppl JSON (e.g. 64 passages)")
    p.add_argument(
        "--chosen",
        nargs="+",
        required=True,
        help="eval ppl JSONs the choice looked at: their passages' text windows are excluded",
    )
    p.add_argument("--out", default=None, help="also write the table to this text file")
    p.set_defaults(func=cmd_held_out)

    p = sub.add_parser("methods", help="list the registered methods and their parameters")
    p.set_defaults(func=cmd_methods)

    p = subparsers.add_parser("report", help="regenerate reports/README.md from the JSON results")
    p.add_argument(
        "--results", default="reports", help="folder of JSON results (default %(default)s)"
    )
    p.add_argument("--out", default=None, help="markdown path (default: RESULTS/README.md)")
    p.add_argument(
        "--all-command",
        default=None,
        help="the command that regenerates everything, quoted at the top of the page",
    )
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kakeyaturbo")
    sub = parser.add_subparsers(dest="command", metavar="{eval,report}")
    sub.required = True
    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args._argv = argv
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
