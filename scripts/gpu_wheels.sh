#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, for GPU_CHECK_WHEELS (scripts/gpu_check.sh): such a machine
# has no package index, but its python (3.12) already holds a CUDA torch. Run here, after
# scripts/setup.sh; writes .whl/ (ignored by git) and prints
# its size. DeepSpeed is built from its sdist with no ops (pure Python; ops JIT-build there).
#   bash scripts/gpu_wheels.sh && GPU_CHECK_PYTHON=python3 GPU_CHECK_WHEELS=.whl bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p .whl
platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# the versions this checkout runs with (pyproject.toml pins deepspeed and transformers)
pins=$(python -m pip list --format=freeze | grep -iE '^(transformers|datasets|dill|multiprocess|fsspec|hjson|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|regex)==')
# shellcheck disable=SC2086
python -m pip download -q --no-deps $platform -d .whl $pins
# NVIDIA's cuDNN frontend for the bottom-right slice attention ("auto" takes it; model/cuda/attention_cudnn.py): pure bindings, it
# runs the libcudnn the lent machine's torch brings
# shellcheck disable=SC2086
python -m pip download -q --no-deps $platform -d .whl "$(python -c 'from tp_trainer.model.cuda.attention_cudnn import PIN; print(PIN)')"
python -m pip download -q --no-deps --no-binary=:all: -d .whl/src "deepspeed==$(python -m pip show deepspeed | sed -n 's/^Version: //p')"
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-*.tar.gz
rm -rf .whl/src
ls .whl; du -sh .whl
