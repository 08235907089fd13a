#!/usr/bin/env bash
# The checks a CUDA machine runs first (docs/performance.md): the compiled Triton kernels and the GPU
# paths against torch (tests/gpu/test_cuda.py), then a decode step of SmolLM2 at 4k and 8k beside
# DynamicCache's, with the kernels and without (KAKEYATURBO_TRITON=0), then generate there
# (benches/hf_generate.py). Output in $OUT (default .gpu/out). On a machine without network,
# stage the inputs with scripts/gpu_stage.sh and carry them in three calls on one warm machine,
# the tests in the first call (they need only kt-ref-a) and the timings in the last:
#
#     bash scripts/gpu_checks.sh unpack 1 && bash scripts/gpu_checks.sh tests   # carrying .gpu/1
#     bash scripts/gpu_checks.sh unpack 2                                        # carrying .gpu/2
#     bash scripts/gpu_checks.sh unpack 3 && bash scripts/gpu_checks.sh bench   # .gpu/3, artifacts/calib-smollm2-joint-both
#
# `run` is `tests` then `bench`, where ../shared, kakeyaturbo and transformers are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${KT_GPU_STASH:-/tmp/kt-gpu}
OUT=${OUT:-.gpu/out}
GGUF=../shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
CALIBRATION=artifacts/calib-smollm2-joint-both

# The staged wheels on the path and the staged ../shared, where they were carried; the GGUF
# joined once all three of its parts are there.
setup() {
  if [ -d "$STASH/wheels" ]; then
    [ -d "$STASH/site" ] || python3 -m pip install -q --no-deps --target "$STASH/site" "$STASH"/wheels/*.whl
    export PYTHONPATH="$STASH/site${PYTHONPATH:+:$PYTHONPATH}"
    gguf="$STASH/shared/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$gguf" ] && [ -f "$STASH/smollm2.part3" ]; then
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
  export PYTHONUNBUFFERED=1
}

tests() {
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -m pytest -q -p no:cacheprovider -p no:benchmark tests/gpu/test_cuda.py -v -rs 2>&1 |
    tee "$OUT/test_cuda.txt" | grep -E "PASSED|FAILED|SKIPPED|passed|failed" || true
}

bench() {
  step=(python3 benches/device_decode_step.py --device cuda --dtype bfloat16
    --calibration "$CALIBRATION" --contexts 4096 8064 --steps 32)
  "${step[@]}" 2>&1 | tee "$OUT/decode_step_triton.txt" | grep -E "^ctx|per step|Triton" || true
  # generate as issue 13's bars read it: tokens/s, prefill and bytes held (codes held once,
  # on the GPU) beside DynamicCache's.
  timeout 300 python3 benches/hf_generate.py --device cuda --dtype bfloat16 --threads 0 \
    --model "$GGUF" --contexts 4096 8064 --new-tokens 128 --budgets 0 --hot-dtype bfloat16 \
    --calibration "$CALIBRATION" 2>&1 | tee "$OUT/hf_generate.txt" | grep -vE "it/s|Warning" || true
  KAKEYATURBO_TRITON=0 "${step[@]}" 2>&1 | tee "$OUT/decode_step_torch.txt" |
    grep -E "^ctx|per step" || true
}

case "${1:-run}" in
unpack)
  mkdir -p "$STASH"
  cp -r ".gpu/$2/." "$STASH/"
  [ -f "$STASH/smollm2.part" ] && mv "$STASH/smollm2.part" "$STASH/smollm2.part$2"
  ls "$STASH"
  ;;
tests) setup && tests ;;
bench) setup && bench ;;
run) setup && tests && bench ;;
*)
  echo "usage: gpu_checks.sh unpack N | tests | bench | run" >&2
  exit 2
  ;;
esac
