#!/usr/bin/env bash
# The checks a CUDA machine runs first (docs/speed.md): the compiled Triton kernels and the GPU
# paths against torch (tests/test_cuda.py), then a decode step of SmolLM2 at 4k and 8k beside
# DynamicCache's, with the kernels and without (KAKEYATURBO_TRITON=0), then generate there
# (benches/hf_generate.py). Output in $OUT (default .gpu/out). On a machine without network,
# stage the inputs with scripts/gpu_stage.sh:
#
#     bash scripts/gpu_checks.sh unpack 1   # after carrying .gpu/1; then 2, then 3
#     bash scripts/gpu_checks.sh run
#
# `run` alone, where ../shared, kakeyaturbo and transformers are already there, runs the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${KT_GPU_STASH:-/tmp/kt-gpu}
OUT=${OUT:-.gpu/out}
case "${1:-run}" in
unpack)
  mkdir -p "$STASH"
  cp -r ".gpu/$2/." "$STASH/"
  [ -f "$STASH/smollm2.part" ] && mv "$STASH/smollm2.part" "$STASH/smollm2.part$2"
  ls "$STASH"
  ;;
run)
  if [ -d "$STASH/wheels" ]; then
    [ -d "$STASH/site" ] || python3 -m pip install -q --no-deps --target "$STASH/site" "$STASH"/wheels/*.whl
    export PYTHONPATH="$STASH/site${PYTHONPATH:+:$PYTHONPATH}"
    gguf="$STASH/shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$gguf" ]; then
      mkdir -p "$(dirname "$gguf")"
      cat "$STASH"/smollm2.part1 "$STASH"/smollm2.part2 "$STASH"/smollm2.part3 > "$gguf"
      [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$STASH/smollm2.sha256")" ]
    fi
    [ -e ../shared ] || ln -sfn "$STASH/shared" ../shared
  fi
  if ! python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "gpu_checks: torch sees no CUDA device here" >&2
    exit 1
  fi
  mkdir -p "$OUT"
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -v -s 2>&1 | tee "$OUT/test_cuda.txt" || true
  step=(python3 benches/device_decode_step.py --device cuda --dtype bfloat16
    --calibration artifacts/calib-smollm2-joint-both --contexts 4096 8064)
  "${step[@]}" 2>&1 | tee "$OUT/decode_step_triton.txt" || true
  KAKEYATURBO_TRITON=0 "${step[@]}" 2>&1 | tee "$OUT/decode_step_torch.txt" || true
  # generate as issue 13's bars read it: tokens/s, prefill and bytes held (codes held once,
  # on the GPU) beside DynamicCache's.
  timeout 300 python3 benches/hf_generate.py --device cuda --dtype bfloat16 --threads 0 \
    --model ../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
    --contexts 4096 8064 --new-tokens 128 --budgets 0 --hot-dtype bfloat16 \
    --calibration artifacts/calib-smollm2-joint-both 2>&1 | tee "$OUT/hf_generate.txt" || true
  ;;
*)
  echo "usage: gpu_checks.sh unpack N | run" >&2
  exit 2
  ;;
esac
