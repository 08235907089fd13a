"""Running a script with the Triton kernels in Triton's interpreter, on the CPU: the variable
must be set before Triton is imported, so each script runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, *args: str) -> str:
    """``script``'s stdout, run with ``TRITON_INTERPRET=1`` (its failure fails the caller)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
