#!/usr/bin/env bash
# Regenerates everything in reports/: the calibration bundle (on the calibration text), the
# Pareto sweep with every peer, per-layer diagnostics, byte projections, the guardrail
# ablation, the in-forward run, and reports/README.md. About 10 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
MODEL=${MODEL:-../shared/models/kt-ref-a}
EVAL=${EVAL:-../shared/data/wikitext-2-raw-test.txt}
CALIB_TEXT=${CALIB_TEXT:-../shared/data/calibration-text.txt}
C=artifacts/calib
COMMON=(--model "$MODEL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 16 --no-progress)

kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$C" --tokens 100000
kakeyaturbo eval all --model "$MODEL" --text "$EVAL" --out-dir reports --no-progress
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/ablation.json \
  --method kakeya --method kakeya:pre_rope=false --method kakeya:sink=0 \
  --method kakeya:allocation=uniform,bit_width=2 \
  --method kakeya:calibration=$C \
  --method kakeya:calibration=$C,k_bits_per_value=2.0,v_bits_per_value=1.5 \
  --method kakeya:calibration=$C,k_bits_per_value=2.0,v_bits_per_value=1.5,whiten=false \
  --method kakeya:calibration=$C,k_bits_per_value=2.0,v_bits_per_value=1.5,sink=0 \
  --method kakeya:calibration=$C,k_bits_per_value=2.0,v_bits_per_value=1.5,layer_bits=true \
  --method kakeya:calibration=$C,k_bits_per_value=1.5,v_bits_per_value=1.25 \
  --method kakeya:calibration=$C,k_bits_per_value=1.5,v_bits_per_value=1.25,layer_bits=true
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward --out reports/in_forward.json \
  --method kakeya --method kakeya:calibration=$C --method turboquant:bits=3 --method kivi:bits=3
# The same methods on 48 passages (most of them windows the 16-passage runs never saw).
kakeyaturbo eval ppl --model "$MODEL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 48 \
  --no-progress --out reports/generalisation.json --method kakeya \
  --method kakeya:bits_per_value=1.5 --method kakeya:calibration=$C \
  --method turboquant:bits=3 --method kivi:bits=3
# The vLLM hooks end to end on the reference model in vLLM's layout (about a minute).
python benches/vllm_hooks.py --calibration "$C" --out reports/vllm_hooks.json
cp "$C/calibration.json" reports/calibration.json
kakeyaturbo report --all-command "bash scripts/reports.sh"
