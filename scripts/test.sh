#!/usr/bin/env bash
# The whole test suite: Rust format, lints and tests, Python lints, stub check, pytest, and the
# built wheel in a fresh virtualenv without torch (scripts/check_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== cargo fmt";    cargo fmt --all --check
echo "== cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test";   cargo test --workspace
echo "== ruff";         ruff check python tests benches scripts
echo "== stubtest";     python -m mypy.stubtest kakeyaturbo._core
echo "== pytest";       python -m pytest -q "$@"
echo "== wheel";        bash scripts/check_wheel.sh
