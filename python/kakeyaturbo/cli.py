"""The ``kakeyaturbo`` command line. Each sub-command lives in its own module and
registers itself; optional ones (evaluation, calibration) are skipped with a note when
their dependencies are missing."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# module path -> what it provides; each module has register(subparsers).
_COMMANDS = [
    "kakeyaturbo.bench_cli",
    "kakeyaturbo.capture_cli",
    "kakeyaturbo.eval.cli",
    "kakeyaturbo.calibration.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kakeyaturbo", description="KV-cache codec tools")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _COMMANDS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and (e.name == mod or mod.startswith(e.name + ".")):
                continue  # that command is not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Sub-commands record the command line that made their results.
    args._argv = list(sys.argv[1:] if argv is None else argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
