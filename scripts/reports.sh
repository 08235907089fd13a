#!/usr/bin/env bash
# Regenerates reports/ on SmolLM2-135M (the yardstick) and reports/kt-ref-a/ (the small second
# model): a calibration bundle with its sensitivity scan (calibration text only), the Pareto
# sweep against every peer with nothing exact but 4 sinks, the same sweep with the protocol the
# product ships (4 sinks and the last 32 tokens exact for every method alike), in-forward
# runs (plain, and with each query's newest 128 tokens exact), the copying test, K/V attribution, the
# output-weighted value frame, one frame across heads, 64 passages of the default and its 4-bit
# peers, and reports/README.md. About 85 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
MODEL=${MODEL:-$(bash scripts/fetch_smollm2.sh)}
EVAL=${EVAL:-../shared/data/wikitext-2-raw-test.txt}
CALIB_TEXT=${CALIB_TEXT:-../shared/data/calibration-text.txt}
SMALL=${SMALL:-../shared/models/kt-ref-a}
C=artifacts/calib-smollm2
COMMON=(--model "$MODEL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 16 --no-progress)
# kakeya points: the self-calibrated default, then the calibrated recipe at several rates.
KAKEYA=(kakeya "kakeya:calibration=$C,bits_per_value=1.25" "kakeya:calibration=$C,bits_per_value=1.5"
  "kakeya:calibration=$C,bits_per_value=1.75" "kakeya:calibration=$C,bits_per_value=2"
  "kakeya:calibration=$C,bits_per_value=2.25"
  "kakeya:calibration=$C" "kakeya:calibration=$C,bits_per_value=2.75"
  "kakeya:calibration=$C,bits_per_value=3.25" "kakeya:calibration=$C,bits_per_value=4"
  "kakeya:calibration=$C,bits_per_value=5.5")
PEERS=("kivi:bits={bits}" "turboquant:bits={bits}" fp8 "hf-quanto:bits={bits}"
  "hf-hqq:bits={bits}")
families() { for f in "${KAKEYA[@]}" "$@"; do printf -- '--family\n%s\n' "$f"; done; }

# A bundle already there is reused (delete artifacts/ to fit it again: about 8 minutes).
[ -f "$C/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$C" --tokens 30000
mapfile -t FAM < <(families "${PEERS[@]}")
kakeyaturbo eval sweep "${COMMON[@]}" "${FAM[@]}" --bits 2 3 4 --out reports/sweep.json \
  --plot reports/pareto.png
mapfile -t FAM < <(families "kivi:bits={bits}" "turboquant:bits={bits}" fp8)
kakeyaturbo eval sweep "${COMMON[@]}" "${FAM[@]}" --bits 2 3 4 \
  --options sink_tokens=4,residual_length=32 --out reports/sweep_window32.json \
  --plot reports/pareto_window32.png
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward --out reports/in_forward.json \
  --method kakeya --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,bits_per_value=3.25" \
  --method kivi:bits=4 --method kivi:bits=3 --method turboquant:bits=4 --method fp8
# In-forward with each prefill query reading its newest 128 tokens exact (KakeyaCache's hot
# window while generating): the compounding a long generation sees.
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward-hot --out reports/in_forward_hot.json \
  --method kakeya --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,bits_per_value=3.25" \
  --method kivi:bits=4 --method kivi:bits=3 --method turboquant:bits=4 --method fp8
kakeyaturbo eval ppl "${COMMON[@]}" --copy --out reports/copy.json \
  --method kakeya --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,bits_per_value=3.25" \
  --method kivi:bits=4 --method turboquant:bits=4 --method fp8
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/attribution.json \
  --method "kakeya:calibration=$C,streams=k" --method "kakeya:calibration=$C,streams=v" \
  --method "kakeya:calibration=$C,layer_bits=false" --method "kakeya:calibration=$C,v_token_norms=false" \
  --method "kakeya:calibration=$C,whiten=false" --method "kakeya:calibration=$C,recent_tokens=0"
# The default's 256-token blocks against 512 (what the cache's smaller exact part costs here).
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/block_size.json \
  --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,block_size=512" \
  --method kakeya --method "kakeya:block_size=512"
# The values' frame weighted by the output projection (calibrate --value-metric output) against
# the default bundle's plain PCA frame, snapshot and in-forward: measured, not adopted.
CV=artifacts/calib-smollm2-vo
[ -f "$CV/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CV" --tokens 30000 \
    --value-metric output
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/value_frame.json \
  --method "kakeya:calibration=$C" --method "kakeya:calibration=$CV"
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward --out reports/value_frame_in_forward.json \
  --method "kakeya:calibration=$C" --method "kakeya:calibration=$CV"
# One coding frame across each layer's KV heads (calibrate --joint-heads; KakeyaCache then
# decodes its blocks instead of attending over the codes): snapshot at four rates, in-forward,
# in-forward with the newest 128 tokens exact, and the copying test.
CJ=artifacts/calib-smollm2-joint
[ -f "$CJ/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CJ" --tokens 30000 \
    --joint-heads
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/joint_heads.json \
  --method "kakeya:calibration=$CJ" --method "kakeya:calibration=$CJ,bits_per_value=2.25" \
  --method "kakeya:calibration=$CJ,bits_per_value=2" --method "kakeya:calibration=$CJ,bits_per_value=1.75"
for mode in in-forward in-forward-hot; do
  kakeyaturbo eval ppl "${COMMON[@]}" --mode $mode --out "reports/joint_heads_${mode//-/_}.json" \
    --method "kakeya:calibration=$CJ" --method "kakeya:calibration=$CJ,bits_per_value=2"
done
kakeyaturbo eval ppl "${COMMON[@]}" --copy --out reports/joint_heads_copy.json \
  --method "kakeya:calibration=$CJ" --method "kakeya:calibration=$CJ,bits_per_value=2"
# The same frames with per-layer bits from both scans (--sensitivity-mode both, about 20
# minutes more): in-forward ACCEPT at 5.24x.
CJB=artifacts/calib-smollm2-joint-both
[ -f "$CJB/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CJB" --tokens 30000 \
    --joint-heads --sensitivity-mode both
for mode in snapshot in-forward in-forward-hot; do
  kakeyaturbo eval ppl "${COMMON[@]}" --mode $mode --out "reports/joint_heads_both_${mode//-/_}.json" \
    --method "kakeya:calibration=$CJB" --method "kakeya:calibration=$CJB,bits_per_value=2"
done
# The default and the two 4-bit peers on 64 passages (the bar asks for >= 16): the verdicts and
# delta-ppl per unit KL with intervals half as wide.
kakeyaturbo eval ppl --model "$MODEL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 64 --no-progress \
  --out reports/passages64.json --method "kakeya:calibration=$C" --method kivi:bits=4 \
  --method turboquant:bits=4 --method "kakeya:calibration=$C,streams=v"
cp "$C/calibration.json" reports/calibration.json
kakeyaturbo report --all-command "bash scripts/reports.sh"

# The small reference model: no regression there (its own bundle).
CS=artifacts/calib-kt-ref-a
mkdir -p reports/kt-ref-a
[ -f "$CS/calibration.json" ] ||
  kakeyaturbo calibrate --model "$SMALL" --text "$CALIB_TEXT" --out "$CS" --tokens 30000
kakeyaturbo eval ppl --model "$SMALL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 16 \
  --no-progress --out reports/kt-ref-a/ppl.json --method kakeya --method "kakeya:calibration=$CS" \
  --method kivi:bits=4 --method kivi:bits=3 --method turboquant:bits=3 --method fp8
python benches/vllm_hooks.py --calibration "$CS" --out reports/kt-ref-a/vllm_hooks.json
kakeyaturbo report --results reports/kt-ref-a --all-command "bash scripts/reports.sh"
