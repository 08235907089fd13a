#!/usr/bin/env bash
# The whole test suite: Rust format, lints and tests, Python lints, stub check, pytest, and the
# built wheel in a fresh virtualenv without torch (scripts/check_wheel.sh). Each stage prints its
# elapsed time, pytest its 15 slowest tests. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "test.sh: the whole suite takes about 15 minutes on 2 cores (more on a first build)"
last=$SECONDS
stage() {
  if [ -n "${name:-}" ]; then echo "   $name: $((SECONDS - last))s"; fi
  name=$1
  last=$SECONDS
  echo "== $name"
}
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "== failed in stage \"$name\" after ${SECONDS}s"; fi' EXIT
stage "set up";       bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
stage "cargo fmt";    cargo fmt --all --check
stage "cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
stage "cargo test";   cargo test --workspace
stage "ruff";         ruff check python tests benches scripts
stage "stubtest";     python -m mypy.stubtest kakeyaturbo._core
stage "pytest";       python -m pytest -q --durations=15 "$@"
stage "wheel";        bash scripts/check_wheel.sh
echo "   $name: $((SECONDS - last))s"
echo "== all passed in ${SECONDS}s"
