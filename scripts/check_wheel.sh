#!/usr/bin/env bash
# The package as a user installs it: build the abi3 wheel, install it into a fresh virtualenv
# with its base dependencies only (numpy, tqdm, safetensors: no torch, no transformers), then
# check that the codec and the numpy-only commands work there and that every optional command
# names the extra it needs. Reuses the cargo target dir, so it is quick after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
MATURIN=maturin
[ -x .venv/bin/maturin ] && MATURIN=.venv/bin/maturin

echo "== build the wheel"
log=$("$MATURIN" build --release -o dist/ 2>&1) || { echo "$log"; exit 1; }
wheel=$(printf '%s\n' "$log" | grep -o '[^ ]*kakeyaturbo-[^ ]*\.whl' | tail -1)
[ -f "$wheel" ] || { echo "$log"; echo "check_wheel: no wheel found in the output above"; exit 1; }
echo "$wheel"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== install it into a fresh virtualenv ($tmp/venv)"
"${PYTHON:-python3}" -m venv "$tmp/venv"
bin="$tmp/venv/bin"
"$bin/python" -m pip install -q "$wheel"
cd "$tmp"  # away from the source tree: only the installed package is importable
"$bin/python" -c "
import importlib.util as u
extra = [m for m in ('torch', 'transformers', 'gguf') if u.find_spec(m)]
assert not extra, f'the base install pulled in {extra}'
"

echo "== the codec: encode/decode round trips, through bytes too"
"$bin/python" - <<'EOF'
import numpy as np
from safetensors.numpy import save_file

import kakeyaturbo as kt

rng = np.random.default_rng(0)
kv = (rng.standard_normal((4, 512, 64)) * np.linspace(3, 0.1, 64)).astype(np.float32)
p = kt.CodecParams(bit_width=4)
enc = kt.encode_layer(kv[0], p)
blob = enc.to_bytes()
assert enc.nbytes == len(blob)
back = kt.decode_layer(kt.EncodedLayer.from_bytes(blob))
rel = np.linalg.norm(back - kv[0]) / np.linalg.norm(kv[0])
assert back.shape == kv[0].shape and rel < 0.15, rel
batch = kt.decode_batch(kt.encode_batch(kv, p))
assert batch.shape == kv.shape and np.linalg.norm(batch - kv) / np.linalg.norm(kv) < 0.15
np.save("kv.npy", kv)
save_file({"layer0.k": kv, "layer0.v": kv[::-1].copy()}, "kv.safetensors")
print(f"round trip ok: relative error {rel:.4f}, {enc.nbytes} bytes")
EOF

echo "== the numpy-only commands"
"$bin/kakeyaturbo" --version
"$bin/kakeyaturbo" --help | grep -q "bench"
"$bin/kakeyaturbo" bench kv.npy --repeats 1 --stages >bench-npy.json
"$bin/kakeyaturbo" bench kv.safetensors --tensor layer0.k --repeats 1 >bench-st.json
"$bin/python" -c "
import json
for f in ('bench-npy.json', 'bench-st.json'):
    r = json.load(open(f))
    assert r['shape'] == [4, 512, 64] and r['ratio_vs_bf16'] > 1, r
print('bench ok: ratio', round(r['ratio_vs_bf16'], 2))
"

echo "== the optional parts name their extra"
expect_extra() {  # expect_extra EXTRA COMMAND...: fails, and says pip install 'kakeyaturbo[EXTRA]'
  local extra=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "check_wheel: '$*' succeeded without kakeyaturbo[$extra]"; exit 1
  fi
  if ! grep -qF "pip install 'kakeyaturbo[$extra]'" <<<"$out"; then
    printf '%s\n' "$out"; echo "check_wheel: '$*' did not name kakeyaturbo[$extra]"; exit 1
  fi
  echo "ok: $(tail -1 <<<"$out")"
}
data=(--model model --text text.txt)
expect_extra eval "$bin/kakeyaturbo" eval ppl "${data[@]}" --method kakeya
expect_extra eval "$bin/kakeyaturbo" eval methods
expect_extra hf "$bin/kakeyaturbo" capture "${data[@]}" --out kv2.safetensors
expect_extra hf "$bin/kakeyaturbo" calibrate "${data[@]}" --out calib
expect_extra hf "$bin/python" -c "import kakeyaturbo.hf"
echo "check_wheel: ok ($(basename "$wheel"))"
