"""What each `kakeyaturbo eval` sub-command and `kakeyaturbo report` do, once `eval.cli` has
parsed and checked their arguments."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from kakeyaturbo.cli_args import UsageError, command_line


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _check_specs(specs: list[str], extra: dict | None = None, flag: str = "--method") -> None:
    """Builds every method of ``specs`` once, before any model loads: an unknown name, key or
    value, or a calibration bundle that is not there, is a `UsageError` naming the spec."""
    from kakeyaturbo.eval.registry import build_method

    for spec in specs:
        try:
            build_method(spec, extra)
        except ImportError:
            raise  # a missing package: the CLI names the extra that installs it
        except Exception as exc:  # noqa: BLE001 - any failure to build is the spec's fault
            raise UsageError(f"{flag} {spec!r}: {exc}") from exc


def _check_copy(args) -> None:
    if getattr(args, "copy", False) and args.n_eval >= args.ctx:
        raise UsageError(
            f"--copy needs --n-eval < --ctx (scored tokens in the copy), got "
            f"{args.n_eval} >= {args.ctx}"
        )


def _failed(rows: list[dict], out) -> bool:
    """Says each method that failed; True (and nothing is written) when any did."""
    bad = [r for r in rows if r.get("error")]
    for r in bad:
        _say(f"{r['method']:40s} ERROR: {r['error']}")
    if bad:
        _say(f"{len(bad)} of {len(rows)} methods failed: {out} not written")
    return bool(bad)


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
        raise UsageError(f"--options: {unknown} are not shared options {COMMON_KEYS}")
    return opts


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def _say_scores(row: dict, width: int, note: str | None, tail: str = "") -> None:
    """One method's line: its ratio and quality, or ``note``, why it has none."""
    if note:
        _say(f"{row['method']:{width}s} {note}")
        return
    _say(
        f"{row['method']:{width}s} ratio {row['ratio']:6.2f}x  "
        f"dppl {100 * row['delta_ppl']:+7.3f}%  KL {row['kl']:.2e}  "
        f"top1 {100 * row['top1']:5.1f}%  {row['verdict']}{tail}"
    )


def cmd_ppl(args) -> int:
    from kakeyaturbo.eval.ppl import ppl_result, write_json

    _check_copy(args)
    _check_specs(args.method, {"streams": args.streams} if args.streams else None)
    setup = _setup(args)
    res = ppl_result(
        setup, args.method, args.mode, args.streams, command_line(args), _progress(args)
    )
    if _failed(res["methods"], args.out):
        return 1
    write_json(res, args.out)
    for r in res["methods"]:
        _say_scores(r, 40, r.get("skipped") and f"skipped: {r['skipped']}")
    _say(f"wrote {args.out}")
    return 0


def cmd_sweep(args) -> int:
    from kakeyaturbo.eval.ppl import environment, run_methods, write_json
    from kakeyaturbo.eval.sweep import DEFAULT_FAMILIES, expand, plot_pareto, sweep_table

    t0 = time.perf_counter()
    _check_copy(args)
    args.family = args.family or list(DEFAULT_FAMILIES)
    try:
        specs = expand(args.family, args.bits)
    except (KeyError, IndexError, ValueError) as exc:
        raise UsageError(f"--family: a template takes {{bits}} only ({exc!r})") from exc
    shared = _shared_options(args.options)
    _check_specs(specs, shared, "--family")
    setup = _setup(args)
    rows = run_methods(setup, specs, args.mode, shared, _progress(args), label="sweep")
    if _failed(rows, args.out):
        return 1
    plot = args.plot or str(Path(args.out).with_suffix(".png"))
    res = {
        "kind": "sweep",
        "command": command_line(args),
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
        pareto = f"{'':{8 - len(e.get('verdict', ''))}s} PARETO" if e.get("pareto") else ""
        _say_scores(e, 34, e.get("note") and f"not run: {e['note']}", pareto)
    _say(f"wrote {args.out} and {plot}")
    return 0


def cmd_layers(args) -> int:
    from kakeyaturbo.eval.diagnostics import layer_diagnostics
    from kakeyaturbo.eval.ppl import write_json

    specs = args.method or ["kakeya"]
    _check_copy(args)
    _check_specs(specs)
    setup = _setup(args)
    sections = [layer_diagnostics(setup, spec, _progress(args)) for spec in specs]
    out = Path(args.out)
    for i, sec in enumerate(sections):
        path = out if len(sections) == 1 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        write_json(
            {
                "kind": "layers",
                "command": command_line(args),
                **setup.config(),
                "mode": "mixed",
                **sec,
            },
            path,
        )
        _say(f"wrote {path}")
    return 0


def cmd_bytes(args) -> int:
    from kakeyaturbo.eval.bytes_report import bytes_result
    from kakeyaturbo.eval.ppl import write_json
    from kakeyaturbo.modeling import load_model, read_text, tokenize_text

    specs = args.method or ["kakeya"]
    _check_specs(specs)
    model, tok = load_model(args.model)
    ids = tokenize_text(tok, read_text(args.text))
    res = bytes_result(
        model,
        ids,
        specs,
        args.contexts,
        args.fit_max,
        args.project,
        command_line(args),
        _progress(args),
    )
    res.update(model=str(args.model), text=str(args.text))
    if _failed(res["methods"], args.out):
        return 1
    write_json(res, args.out)
    for m in res["methods"]:
        if m.get("skipped"):
            _say(f"{m['method']:30s} {m['skipped']}")
            continue
        val = ", ".join(f"{v['rel_error']:+.4%} @{v['tokens']}" for v in m["validation"])
        proj = ", ".join(f"{p['tokens'] // 1024}k {p['ratio']:.2f}x" for p in m["projection"])
        _say(f"{m['method']:30s} projection {proj}; check vs measured {val}")
    _say(f"wrote {args.out}")
    return 0


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

    _check_copy(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = ["--model", str(args.model), "--text", str(args.text)]
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
    parser = args.make_parser()
    all_command = command_line(args)
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
    text = "$ " + command_line(args) + "\n" + format_held_out(result, rows) + "\n"
    if args.out:
        from kakeyaturbo.cli_args import atomic_path

        with atomic_path(args.out) as tmp:
            tmp.write_text(text)
    print(text, end="")
    return 0


def cmd_table(args) -> int:
    import json

    from kakeyaturbo.eval.summary import format_table

    try:
        result = json.loads(Path(args.result).read_text())
        print(format_table(result, args.mark))
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{args.result}: not an eval ppl or sweep result ({exc})") from exc
    return 0


def cmd_methods(args) -> int:
    from kakeyaturbo.eval.methods import COMMON_KEY_VALUES
    from kakeyaturbo.eval.registry import METHOD_HELP

    for name in sorted(METHOD_HELP):
        print(f"{name:12s} {METHOD_HELP[name]}")
    shared = " ".join(f"{key}={form}" for key, form in COMMON_KEY_VALUES.items())
    print(f"\nshared options: {shared}; a k_/v_ prefix applies a key to one stream")
    return 0
