"""Running a script with the Triton kernels in Triton's interpreter, on the CPU: the variable
must be set before Triton is imported, so each script runs in a fresh process. Each launch it
makes is then compiled for real GPUs (``triton_launches.py``): the interpreter alone does not
see what only the compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from triton_launches import compile_recorded  # tests/support (pythonpath)

TESTS = Path(__file__).resolve().parent
# Records the launches, then runs the script (in KT_SCRIPT) with its own arguments in argv.
_RUNNER = (
    "import os, sys; sys.path.insert(0, os.environ['KT_TESTS']); import triton_launches; "
    "triton_launches.record(os.environ['KT_TRITON_LAUNCHES']); "
    "exec(compile(os.environ['KT_SCRIPT'], '<interpreted>', 'exec'))"
)


def run_interpreted(script: str, *args: str) -> str:
    """``script``'s stdout, run with ``TRITON_INTERPRET=1`` (its failure fails the caller),
    after which each distinct launch it made must compile for every GPU target."""
    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.jsonl"
        env = dict(
            os.environ,
            TRITON_INTERPRET="1",
            KT_TESTS=str(TESTS),
            KT_TRITON_LAUNCHES=str(launches),
            KT_SCRIPT=script,
        )
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _RUNNER, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert compile_recorded(launches) > 0, "the script launched no kernel"
    return done.stdout
