#!/usr/bin/env bash
# Regenerates reports/ on SmolLM2-135M (the yardstick) and reports/kt-ref-a/ (the small second
# model): the default calibration bundle (calibrate's defaults: one frame across each layer's KV
# heads, per-layer bits from both sensitivity scans; calibration text only), the Pareto sweep
# against every peer with nothing exact but 4 sinks, the same sweep with the protocol the
# product ships (4 sinks and the last 32 tokens exact for every method alike), in-forward runs
# (plain, and with each query's newest 128 tokens exact), the copying test, K/V attribution,
# the per-head bundle (the speed option, docs/recipe.md item 11) and the output-weighted value
# frame beside it, one frame across heads with the snapshot scan alone, 64 passages of the
# per-head bundle and its 4-bit peers, and reports/README.md. About 2 hours on 2 cores with no
# bundle fitted yet, 80 minutes with them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
MODEL=${MODEL:-$(bash scripts/fetch_smollm2.sh)}
EVAL=${EVAL:-../shared/data/wikitext-2-raw-test.txt}
CALIB_TEXT=${CALIB_TEXT:-../shared/data/calibration-text.txt}
SMALL=${SMALL:-../shared/models/kt-ref-a}
C=artifacts/calib-smollm2-joint-both
# Per-head frames with the snapshot scan alone: the speed option (docs/recipe.md item 11).
CP=artifacts/calib-smollm2
# The bundles kept for comparison (per-head, output-weighted values, joint with the snapshot
# scan) run at 2.5 bits, so they compare at one rate with each other (the default bundle runs
# at 2.6; its JSONs name no rate).
AT_2P5=bits_per_value=2.5
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
# The recipe from the default bundle at its rate and at 2 and 3.25 bits, the per-head bundle,
# and the self-calibrated default: the methods of the in-forward and copying runs.
DEFAULTS=(--method kakeya --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,bits_per_value=2"
  --method "kakeya:calibration=$C,bits_per_value=3.25" --method "kakeya:calibration=$CP,$AT_2P5")

# Bundles already there are reused (delete artifacts/ to fit them again: a few minutes each).
[ -f "$C/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$C"
[ -f "$CP/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CP" \
    --no-joint-heads --sensitivity-mode snapshot
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward --out reports/in_forward.json "${DEFAULTS[@]}" \
  --method kivi:bits=4 --method kivi:bits=3 --method turboquant:bits=4 --method fp8
kakeyaturbo eval ppl "${COMMON[@]}" --copy --out reports/copy.json "${DEFAULTS[@]}" \
  --method kivi:bits=4 --method turboquant:bits=4 --method fp8
mapfile -t FAM < <(families "${PEERS[@]}")
kakeyaturbo eval sweep "${COMMON[@]}" "${FAM[@]}" --bits 2 3 4 --out reports/sweep.json \
  --plot reports/pareto.png
mapfile -t FAM < <(families "kivi:bits={bits}" "turboquant:bits={bits}" fp8)
kakeyaturbo eval sweep "${COMMON[@]}" "${FAM[@]}" --bits 2 3 4 \
  --options sink_tokens=4,residual_length=32 --out reports/sweep_window32.json \
  --plot reports/pareto_window32.png
# The Pareto sweep in-forward (every layer reads the reconstructed K/V of the layers before it),
# every peer, the default bundle at six rates from 2.7x to 8.6x.
KAKEYA_IF=("kakeya:calibration=$C,bits_per_value=5.5" "kakeya:calibration=$C,bits_per_value=3.25"
  "kakeya:calibration=$C" "kakeya:calibration=$C,bits_per_value=2"
  "kakeya:calibration=$C,bits_per_value=1.5" "kakeya:calibration=$C,bits_per_value=1.25")
mapfile -t FAM < <(KAKEYA=("${KAKEYA_IF[@]}") && families "${PEERS[@]}")
kakeyaturbo eval sweep "${COMMON[@]}" "${FAM[@]}" --bits 2 3 4 --mode in-forward \
  --out reports/sweep_in_forward.json --plot reports/pareto_in_forward.png
# In-forward with each prefill query reading its newest 128 tokens exact (KakeyaCache's hot
# window while generating): the compounding a long generation sees.
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward-hot --out reports/in_forward_hot.json \
  "${DEFAULTS[@]}" --method kivi:bits=4 --method kivi:bits=3 --method turboquant:bits=4 --method fp8
# The per-head bundle in snapshot at 2.5 and 2 bits (the sweep holds the
# default bundle's points).
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/per_head.json \
  --method "kakeya:calibration=$CP,$AT_2P5" --method "kakeya:calibration=$CP,bits_per_value=2"
# What each choice of the default is worth: a row per choice undone (the frames across heads
# are fitted on whitened keys, so the whitening is undone with them).
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/attribution.json \
  --method "kakeya:calibration=$C,streams=k" --method "kakeya:calibration=$C,streams=v" \
  --method "kakeya:calibration=$C,layer_bits=false" --method "kakeya:calibration=$C,v_token_norms=false" \
  --method "kakeya:calibration=$C,joint_heads=false" \
  --method "kakeya:calibration=$C,joint_heads=false,whiten=false" --method "kakeya:calibration=$C,recent_tokens=0"
# One stream across heads, the other per head (the recipe's joint_heads; docs/recipe.md item 13):
# the keys' frame product across heads is what attention's decode rate pays for.
for mode in snapshot in-forward; do
  kakeyaturbo eval ppl "${COMMON[@]}" --mode $mode --method "kakeya:calibration=$C" \
    --method "kakeya:calibration=$C,joint_heads=v" --method "kakeya:calibration=$C,joint_heads=k" \
    --out "reports/joint_streams$([ $mode = snapshot ] || echo _in_forward).json"
done
# The default's 256-token blocks against 512 (what the cache's smaller exact part costs here).
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/block_size.json \
  --method "kakeya:calibration=$C" --method "kakeya:calibration=$C,block_size=512" \
  --method kakeya --method "kakeya:block_size=512"
# The default bundle and the peers nearest it on 64 passages (the bar asks for >= 16), in each
# protocol: intervals half as wide, and `eval held-out` scores them again on the passages whose
# text overlaps none of the 16-passage runs the default rate was chosen on (54-60 of 64).
P64=(--model "$MODEL" --text "$EVAL" --ctx 960 --n-eval 64 --passages 64 --no-progress
  --method "kakeya:calibration=$C" --method kivi:bits=4 --method kivi:bits=3)
kakeyaturbo eval ppl "${P64[@]}" --out reports/passages64.json --method turboquant:bits=4
kakeyaturbo eval ppl "${P64[@]}" --out reports/passages64_in_forward.json --mode in-forward
kakeyaturbo eval ppl "${P64[@]}" --out reports/passages64_copy.json --copy
for run in passages64 passages64_in_forward passages64_copy; do
  kakeyaturbo eval held-out "reports/$run.json" --out "reports/${run/passages64/held_out}.txt" \
    --chosen reports/sweep.json reports/in_forward.json reports/copy.json >/dev/null
done
# The values' frame weighted by the output projection (calibrate --value-metric output) against
# the per-head bundle's (each channel weighted only), snapshot and in-forward: not adopted.
CV=artifacts/calib-smollm2-vo
[ -f "$CV/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CV" --tokens 30000 \
    --value-metric output --sensitivity-mode snapshot
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/value_frame.json \
  --method "kakeya:calibration=$CP,$AT_2P5" --method "kakeya:calibration=$CV,$AT_2P5"
kakeyaturbo eval ppl "${COMMON[@]}" --mode in-forward --out reports/value_frame_in_forward.json \
  --method "kakeya:calibration=$CP,$AT_2P5" --method "kakeya:calibration=$CV,$AT_2P5"
# One coding frame across each layer's KV heads with per-layer bits from the snapshot scan
# alone (what the in-forward scan adds: compare with the default bundle): snapshot at four
# rates, in-forward, in-forward with the newest 128 tokens exact, and the copying test.
CJ=artifacts/calib-smollm2-joint
[ -f "$CJ/calibration.json" ] ||
  kakeyaturbo calibrate --model "$MODEL" --text "$CALIB_TEXT" --out "$CJ" --tokens 30000 \
    --joint-heads --sensitivity-mode snapshot
kakeyaturbo eval ppl "${COMMON[@]}" --out reports/joint_heads.json \
  --method "kakeya:calibration=$CJ,$AT_2P5" --method "kakeya:calibration=$CJ,bits_per_value=2.25" \
  --method "kakeya:calibration=$CJ,bits_per_value=2" --method "kakeya:calibration=$CJ,bits_per_value=1.75"
for mode in in-forward in-forward-hot; do
  kakeyaturbo eval ppl "${COMMON[@]}" --mode $mode --out "reports/joint_heads_${mode//-/_}.json" \
    --method "kakeya:calibration=$CJ,$AT_2P5" --method "kakeya:calibration=$CJ,bits_per_value=2"
done
kakeyaturbo eval ppl "${COMMON[@]}" --copy --out reports/joint_heads_copy.json \
  --method "kakeya:calibration=$CJ,$AT_2P5" --method "kakeya:calibration=$CJ,bits_per_value=2"
# Outlier channels: SmolLM2 against itself with a 100x value channel and key pair in every
# layer (the same function), with the bundle each model fits on first use.
python benches/outlier_channels.py --passages 8
# Sliding-window layers held exact or coded: SmolLM2 with Gemma 3's layer pattern.
python benches/sliding_layers.py --passages 8
python benches/sliding_cache.py --passages 8
python benches/sliding_cache.py --passages 8 --window 1024 --ctx 2048 \
  --out reports/sliding_cache_w1024.json
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
