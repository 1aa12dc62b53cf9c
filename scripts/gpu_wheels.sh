#!/usr/bin/env bash
# The wheels a bare device machine (Python 3.12, CUDA torch, triton, peft, numpy, pyarrow, numba, einops, ... but not
# this project's other needs) lacks to run benchmarks/gpu_check.py, downloaded here into a git-ignored folder that
# the device tool carries (its `carry` argument: ignored paths, 64 MiB in all with the working tree).
#
#   bash scripts/gpu_wheels.sh            # -> build/gpu-wheels/*.whl (about 21 MiB), then on the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site build/gpu-wheels/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_check --out $OUT/gpu_check.json
#
# --no-deps: each wheel's own needs are either on the machine or listed here (checked against the image's package
# list in /work/.library/device/KINDS.md): megatron-core needs torch, numpy, packaging; fla-core needs einops (its
# cuda extra: torch, triton); transformers 5.19 needs huggingface-hub >= 1.31, tokenizers 0.23.x, safetensors >= 0.8
# (the image has 1.33, 0.23.2, 0.8.0). transformers is carried because the image's is 5.17 and this project is
# tested with 5.19 (Qwen3.5's DeltaNet kernel choice is read from 5.19's source: docs/dependencies.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-build/gpu-wheels}
PY=${PYTHON:-.venv/bin/python}
rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$OUT" \
  'megatron-core==0.16.1' 'fla-core==0.6.0' 'transformers==5.19.0' 'zstandard==0.25.0'
ls -l "$OUT"
du -ch "$OUT"/*.whl | tail -1
