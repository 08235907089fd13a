#!/usr/bin/env bash
# Idempotent set-up: a project virtualenv in .venv with the dev requirements and the
# extension built in release mode (editable, so python/ changes need no rebuild).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements-dev.txt
# LMCache for kakeyaturbo.lmcache (its imports are in requirements-dev.txt; --no-deps keeps
# torch, transformers and numpy as pinned) and a Redis server for its L2 adapter tests.
python -m pip install -q --no-deps "lmcache==0.5.6"
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get install -y -q redis-server >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null; } \
    || echo "setup.sh: could not install redis-server (the Redis tests will skip)"
fi
maturin develop --release -q 2>&1 | grep -vE '^(🔗|📦|🐍|✏️|🛠|🍹|⚠️  Warning: You)' || true
python -c "import kakeyaturbo; print('kakeyaturbo', kakeyaturbo.__version__, 'ready')"
