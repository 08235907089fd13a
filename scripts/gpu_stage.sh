#!/usr/bin/env bash
# Stages what scripts/gpu_checks.sh needs on a CUDA machine that has torch but no network, in
# parts of at most 58 MB (for a runner that carries 64 MiB per call): .gpu/1 the kakeyaturbo
# wheel, the transformers and gguf wheels (for the machine's Python), kt-ref-a, the texts and
# the first piece of the SmolLM2 GGUF; .gpu/2 and .gpu/3 its other pieces. Carry the parts in
# order, running `bash scripts/gpu_checks.sh unpack N` after each, the GPU tests with the first
# (`gpu_checks.sh tests`) and the timings with the last (`gpu_checks.sh bench`;
# artifacts/calib-smollm2-joint-both, 17 MB, carried with .gpu/3): see gpu_checks.sh.
#
#     bash scripts/gpu_stage.sh [python version of the GPU machine, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=.venv/bin/python
rm -rf .gpu && mkdir -p .gpu/1/wheels .gpu/2 .gpu/3
"$PY" -m maturin build --release -q -o .gpu/1/wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/1/wheels transformers==5.24.0 gguf==0.19.0
mkdir -p .gpu/1/shared/models .gpu/1/shared/data
cp -r ../shared/models/kt-ref-a .gpu/1/shared/models/
cp ../shared/data/*.txt .gpu/1/shared/data/
gguf=$(bash scripts/fetch_smollm2.sh)
piece() {  # bytes $2.. of the GGUF, $3 of them (all the rest without)
  dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none
}
piece .gpu/1/smollm2.part 0 12000000
piece .gpu/2/smollm2.part 12000000 58000000
piece .gpu/3/smollm2.part 70000000
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/3/smollm2.sha256
du -sh .gpu/1 .gpu/2 .gpu/3
