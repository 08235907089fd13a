"""What every ``kakeyaturbo`` sub-command's parser shares: one-line argparse errors, path and
number checks run while arguments are parsed (before any model loads), and writing a result
file only when the command succeeds."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ._core import KakeyaTurboError

__all__ = [
    "Parser",
    "UsageError",
    "add_model_argument",
    "add_text_argument",
    "atomic_path",
    "command_line",
    "existing_path",
    "int_at_least",
    "model_path",
    "positive_float",
]


class UsageError(KakeyaTurboError, ValueError):
    """A bad argument found before the work starts: the CLI exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``error: PROG: what``) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def existing_path(kind: str, want: str = "any") -> Callable[[str], Path]:
    """An argparse ``type`` for a path that must exist (``want``: "file", "dir" or "any");
    ``kind`` names it in the error (``model``, ``text file``, ...)."""

    def check(text: str) -> Path:
        path = Path(text)
        if not path.exists():
            raise argparse.ArgumentTypeError(f"{kind} {text!r} does not exist")
        if want == "file" and not path.is_file():
            raise argparse.ArgumentTypeError(f"{kind} {text!r} is not a file")
        if want == "dir" and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{kind} {text!r} is not a folder")
        return path

    return check


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low``."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    check.__name__ = f"int >= {low}"
    return check


def positive_float(text: str) -> float:
    """An argparse ``type``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed to ``path`` when the block ends
    without an error and removed when it raises, so a failed run leaves no partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def model_path(text: str) -> Path:
    """An argparse ``type``: what `kakeyaturbo.modeling.load_model` takes (a Hugging Face
    folder, a GGUF file or a folder holding one), checked without importing torch."""
    path = existing_path("model")(text)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise argparse.ArgumentTypeError(f"model {text!r} is a file but not a .gguf file")
    elif not (path / "config.json").is_file():
        n = len(list(path.glob("*.gguf")))
        if n != 1:
            what = "no .gguf file" if n == 0 else f"{n} .gguf files (name one)"
            raise argparse.ArgumentTypeError(
                f"model {text!r} is not a Hugging Face model folder (no config.json) and "
                f"holds {what}"
            )
    return path


def add_text_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--text``, a text file that must exist, as the commands that read one take it."""
    p.add_argument("--text", required=True, type=existing_path("text file", "file"), help=help)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """``--model``, as every command that loads a model takes it (`kakeyaturbo.modeling`)."""
    p.add_argument(
        "--model",
        required=True,
        type=model_path,
        help="local Hugging Face model folder, or a GGUF file (or a folder holding one)",
    )


def command_line(args: argparse.Namespace) -> str:
    """The command that made ``args``, for results to record: the argv `kakeyaturbo.cli.main`
    parsed (``args._argv``), else this process's own."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        argv = sys.argv[1:]
    return "kakeyaturbo " + shlex.join(argv)
