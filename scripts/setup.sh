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
maturin develop --release -q 2>&1 | grep -vE '^(🔗|📦|🐍|✏️|🛠|🍹|⚠️  Warning: You)' || true
python -c "import kakeyaturbo; print('kakeyaturbo', kakeyaturbo.__version__, 'ready')"
