#!/usr/bin/env bash
# The main job on the default input: set up, capture real K/V from the reference model,
# report the codec's bytes and error on them, then evaluate the default recipe end to end
# (perplexity, top-1, KL against the uncompressed model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
MODEL=${MODEL:-../shared/models/kt-ref-a}
TEXT=${TEXT:-../shared/data/wikitext-2-raw-test.txt}
mkdir -p artifacts
kakeyaturbo capture --model "$MODEL" --text "$TEXT" --tokens 1024 --out artifacts/kv.safetensors
# The recipe's key setting on pre-RoPE keys: water-filling over one PCA basis per head.
kakeyaturbo bench artifacts/kv.safetensors --tensor layer2.k_pre_rope --allocation waterfill \
  --k 0 --share-basis --variance-ratio 0.99 --bits-per-value 2 --block-size 1024 --stages
if kakeyaturbo eval --help >/dev/null 2>&1; then
  kakeyaturbo eval ppl --model "$MODEL" --text "$TEXT" --ctx 960 --n-eval 64 --passages 4 \
    --method kakeya --out artifacts/eval.json
fi
