"""Command line: `kakeyaturbo eval {ppl,sweep,layers,bytes,all,held-out,methods}` and
`kakeyaturbo report`.

`register(subparsers)` adds both commands to the top-level `kakeyaturbo` parser;
`python -m kakeyaturbo.eval.cli ...` runs the same commands without it.

Every argument, path and method spec is checked before the model loads (a typo in a spec costs
seconds, not a reference pass), and a command that fails writes no result file.
"""

from __future__ import annotations

import argparse
import sys

from kakeyaturbo.cli_args import (
    Parser,
    add_model_argument,
    add_text_argument,
    existing_path,
    int_at_least,
)
from kakeyaturbo.eval.commands import (
    cmd_all,
    cmd_bytes,
    cmd_held_out,
    cmd_layers,
    cmd_methods,
    cmd_ppl,
    cmd_report,
    cmd_sweep,
    cmd_table,
)

#: The harness's protocols (``eval.harness.MODES``; named here so parsing imports no torch).
MODES = ("snapshot", "in-forward", "in-forward-hot")

__all__ = ["main", "register"]

DEFAULT_CTX, DEFAULT_N_EVAL, DEFAULT_PASSAGES = 960, 64, 16


def _add_data(p: argparse.ArgumentParser, passages: bool = True) -> None:
    add_model_argument(p)
    add_text_argument(p, "evaluation text file (never the calibration text)")
    if passages:
        positive = int_at_least(1)
        p.add_argument(
            "--ctx",
            type=positive,
            default=DEFAULT_CTX,
            help="prefix tokens compressed (default %(default)s)",
        )
        p.add_argument(
            "--n-eval",
            type=positive,
            default=DEFAULT_N_EVAL,
            help="teacher-forced tokens scored on top (default %(default)s)",
        )
        p.add_argument(
            "--passages",
            type=positive,
            default=DEFAULT_PASSAGES,
            help="passages (default %(default)s)",
        )
        p.add_argument(
            "--batch",
            type=positive,
            default=16,
            help="passages per forward pass (default %(default)s)",
        )
        p.add_argument(
            "--copy",
            action="store_true",
            help="the copying test: each window written twice, scored on the second copy (a "
            "model that copies exactly shows every KV error in the first)",
        )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _data_parser(sub, name: str, help: str, passages: bool = True) -> argparse.ArgumentParser:
    """A sub-command that reads a model and a text (`_add_data`)."""
    p = sub.add_parser(name, help=help)
    _add_data(p, passages)
    return p


def _add_specs(p, help: str, required: bool = False, flag: str = "--method") -> None:
    """A repeatable method-spec option (`_check_specs` checks them before the model loads)."""
    p.add_argument(flag, action="append", required=required, default=None, help=help)


def register(subparsers) -> None:
    """Add `eval` (with its sub-commands) and `report` to a top-level argparse subparsers object."""
    from kakeyaturbo.eval.sweep import DEFAULT_BITS, DEFAULT_FAMILIES

    ev = subparsers.add_parser(
        "eval",
        help="quality and bytes of KV codecs against peers",
        description="Evaluate KV codecs: perplexity/KL/top-1 and stored bytes.",
    )
    sub = ev.add_subparsers(
        dest="eval_command", metavar="{ppl,sweep,layers,bytes,all,held-out,table,methods}"
    )
    sub.required = True

    p = _data_parser(
        sub, "ppl", "delta-ppl, KL, top-1 and bytes of methods against the uncompressed run"
    )
    _add_specs(
        p,
        "method spec, repeatable: kakeya[:key=value,...], kivi:bits=2, ... (see `eval methods`)",
        required=True,
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

    p = _data_parser(
        sub, "sweep", "method families x bit widths -> Pareto table (JSON) and plot (PNG)"
    )
    _add_specs(
        p,
        f"spec template with {{bits}}, or a fixed spec; repeatable (default: "
        f"{' '.join(DEFAULT_FAMILIES)})",
        flag="--family",
    )
    p.add_argument("--bits", type=int_at_least(1), nargs="+", default=DEFAULT_BITS)
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

    p = _data_parser(
        sub, "layers", "per-layer sensitivity, depth compounding, K-only/V-only attribution"
    )
    _add_specs(p, "method spec, repeatable (default: kakeya)")
    p.add_argument("--out", default="reports/layers.json")
    p.set_defaults(func=cmd_layers)

    p = _data_parser(
        sub,
        "bytes",
        "per-layer bytes at several contexts and a projection to long contexts",
        passages=False,
    )
    _add_specs(p, "method spec, repeatable (default: kakeya)")
    positive = int_at_least(1)
    p.add_argument("--contexts", type=positive, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument(
        "--fit-max", type=positive, default=1024, help="longest prefix used to fit unit costs"
    )
    p.add_argument("--project", type=positive, nargs="+", default=[32768, 65536, 131072, 262144])
    p.add_argument("--out", default="reports/bytes.json")
    p.set_defaults(func=cmd_bytes)

    p = _data_parser(sub, "all", "regenerate reports/: sweep + plot, diagnostics, bytes, README")
    p.add_argument("--out-dir", default="reports")
    p.add_argument("--skip", nargs="*", choices=["sweep", "layers", "bytes"], default=[])
    # cmd_all parses each step with this parser: handed over, so commands need not import cli.
    p.set_defaults(func=cmd_all, make_parser=build_parser)

    p = sub.add_parser(
        "held-out",
        help="an eval ppl result re-scored on the passages that the runs a choice was made on "
        "did not evaluate",
    )
    p.add_argument(
        "result", type=existing_path("result", "file"), help="eval ppl JSON (e.g. 64 passages)"
    )
    p.add_argument(
        "--chosen",
        nargs="+",
        type=existing_path("chosen result", "file"),
        required=True,
        help="eval ppl JSONs the choice looked at: their passages' text windows are excluded",
    )
    p.add_argument("--out", default=None, help="also write the table to this text file")
    p.set_defaults(func=cmd_held_out)

    p = sub.add_parser(
        "table", help="an eval ppl or eval sweep result as one short table, best ratio first"
    )
    p.add_argument("result", type=existing_path("result", "file"), help="results JSON")
    p.add_argument("--mark", default=None, help="method spec whose row gets a *")
    p.set_defaults(func=cmd_table)

    p = sub.add_parser("methods", help="list the registered methods and their parameters")
    p.set_defaults(func=cmd_methods)

    p = subparsers.add_parser("report", help="regenerate reports/README.md from the JSON results")
    p.add_argument(
        "--results",
        default="reports",
        type=existing_path("results folder", "dir"),
        help="folder of JSON results (default %(default)s)",
    )
    p.add_argument("--out", default=None, help="markdown path (default: RESULTS/README.md)")
    p.add_argument(
        "--all-command",
        default=None,
        help="the command that regenerates everything, quoted at the top of the page",
    )
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kakeyaturbo")
    sub = parser.add_subparsers(dest="command", metavar="{eval,report}")
    sub.required = True
    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `kakeyaturbo` command line for `eval` and `report` (its errors, its exit status)."""
    from kakeyaturbo.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
