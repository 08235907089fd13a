"""The ``kakeyaturbo`` command line.

Each sub-command lives in its own module with a ``register(subparsers)`` function. Only the
module of the command being run is imported, so ``kakeyaturbo --help`` and ``kakeyaturbo bench``
work on the base install (numpy, tqdm, safetensors) and start without importing torch. A
command whose optional dependencies are missing names the extra to install instead of ending
in a traceback.

Errors are one line on stderr, ``error: ...``, with exit status 2 for a usage error (a bad
argument, method spec or path, found before any model loads) and 1 for a failure while running;
``--debug`` (anywhere on the command line) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from ._core import KakeyaTurboError
from .cli_args import Parser, UsageError


@dataclass(frozen=True)
class _Command:
    module: str  # has register(subparsers), which adds this command's parser
    extra: Optional[str]  # the pip extra holding its dependencies; None: the base install
    help: str  # the line `kakeyaturbo --help` shows without importing the module
    # Packages it cannot run without, looked for before its arguments are checked, so a user
    # without the extra is told to install it rather than to fix an argument first.
    requires: tuple[str, ...] = ()


_COMMANDS = {
    "bench": _Command(
        "kakeyaturbo.bench_cli", None, "encode/decode a .npy/.safetensors tensor, print JSON"
    ),
    "capture": _Command(
        "kakeyaturbo.capture_cli",
        "hf",
        "capture K/V from a local model to .safetensors",
        ("torch", "transformers"),
    ),
    "calibrate": _Command(
        "kakeyaturbo.calibration.cli",
        "hf",
        "fit a calibration bundle (query-aware key frames)",
        ("torch", "transformers"),
    ),
    "eval": _Command(
        "kakeyaturbo.eval.cli",
        "eval",
        "quality and bytes of KV codecs against peers",
        ("torch", "transformers"),
    ),
    "report": _Command(
        "kakeyaturbo.eval.cli", "eval", "regenerate reports/README.md from the JSON results"
    ),
}


# Packages that come with an extra other than the command's own.
_PACKAGE_EXTRA = {"optimum": "peers", "hqq": "peers", "vllm": "vllm"}


class MissingExtraError(KakeyaTurboError, ImportError):
    """A command needs a package that only one of the package's extras installs."""


def _extra_error(command: str, package: str) -> MissingExtraError:
    """The user-facing error for `command` lacking `package`, naming the extra to install."""
    extra = _PACKAGE_EXTRA.get(package, _COMMANDS[command].extra)
    return MissingExtraError(
        f"kakeyaturbo {command} needs {package!r}, which is not installed: "
        f"pip install 'kakeyaturbo[{extra}]'"
    )


def _missing_extra(command: str, exc: ModuleNotFoundError) -> Optional[MissingExtraError]:
    """The user-facing error for `exc`, if it is a third-party package `command` lacks."""
    package = (exc.name or "").split(".")[0]
    if not package or package == "kakeyaturbo" or _COMMANDS[command].extra is None:
        return None
    return _extra_error(command, package)


def _command_of(argv: Sequence[str]) -> Optional[str]:
    """The sub-command `argv` names (the top-level parser's only options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s module imported and registered and the other commands as
    one-line entries for ``--help`` (``None``: entries only).

    Raises `MissingExtraError` when `command` needs an extra that is not installed.
    """
    parser = Parser(prog="kakeyaturbo", description="KV-cache codec tools")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (anywhere in argv)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _COMMANDS.get(command) if command else None
    for name, cmd in _COMMANDS.items():
        if chosen is None or cmd.module != chosen.module:
            sub.add_parser(name, help=cmd.help, add_help=False)
    if chosen is not None:
        for package in chosen.requires:
            if importlib.util.find_spec(package) is None:
                raise _extra_error(command, package)
        try:
            module = importlib.import_module(chosen.module)
        except ModuleNotFoundError as exc:
            err = _missing_extra(command, exc)
            if err is None:
                raise
            raise err from exc
        module.register(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line naming the problem."""
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    else:
        text = str(exc)
    text = " ".join(text.split())
    if not text or isinstance(exc, (OSError, KeyError, RuntimeError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = _command_of(argv)
    try:
        parser = build_parser(command)
    except MissingExtraError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    # Sub-commands record the command line that made their results.
    args._argv = argv
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        if debug:
            raise
        words = [parser.prog, args.command, getattr(args, "eval_command", None)]
        hint = " ".join(w for w in words if w)
        print(f"error: {_one_line(exc)} (see {hint} --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that reports every failure
        if debug:
            raise
        if isinstance(exc, ModuleNotFoundError):
            err = _missing_extra(args.command, exc)
            if err is not None:
                print(f"error: {err}", file=sys.stderr)
                return 1
        print(f"error: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
