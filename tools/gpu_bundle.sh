#!/usr/bin/env bash
# Download, as wheels into one folder, what `python -m tools.gpu_check --bare` needs on a GPU
# machine that has only Python 3.12 and a CUDA build of torch (no internet there):
#
#   tools/gpu_bundle.sh [FOLDER]          # default FOLDER: .whl (git-ignored)
#   # copy the repository and FOLDER to the GPU machine, then there:
#   python3 -m pip install --no-index --no-deps --find-links FOLDER FOLDER/*.whl
#   python3 -m tools.gpu_check --bare
#
# megatron-core 0.19.2 needs torch, numpy and packaging; the bare check's own imports add pyyaml,
# and the entry points it launches (pretrain.pretrain_gpt, pretrain.pretrain_gpt_megatron) tqdm.
# Every wheel is fetched with --no-deps so that torch (and its CUDA libraries) never is: the GPU
# machine's own torch stays. wandb, matplotlib, safetensors and psutil are not needed by the
# bare check (tests/distributed/test_gpu_bare.py makes them unimportable while it runs).
# The versions are requirements.txt's pins; packaging is megatron-core's floor.
set -euo pipefail
cd "$(dirname "$0")/.."
FOLDER="${1:-.whl}"
PY="${PYTHON:-.venv/bin/python}"
pin() { grep -E "^$1==" requirements.txt | head -n1; }
PACKAGES=("$(pin megatron-core)" "$(pin numpy)" "$(pin pyyaml)" "$(pin tqdm)" "packaging==25.0")
for p in "${PACKAGES[@]}"; do
  [[ "$p" == *==* ]] || { echo "error: no pin for a bundled package in requirements.txt" >&2; exit 1; }
done
mkdir -p "$FOLDER"
# Linux x86-64 wheels for CPython 3.12 whatever this machine is; manylinux tags are matched
# exactly, so the usual ones are listed.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$FOLDER" "${PACKAGES[@]}"
ls -l "$FOLDER"
du -sh "$FOLDER"
