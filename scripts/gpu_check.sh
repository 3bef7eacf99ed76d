#!/usr/bin/env bash
# Check the GPU path and calibrate the cost models: benchmarks/gpu_check.py in .venv.
#   bash scripts/gpu_check.sh [--device cpu] [--sizes small|full] [--out DIR] ...
# On a machine with an NVIDIA GPU (nvidia-smi answers), .venv gets the CUDA build of the pinned
# torch: TORCH_SPEC (default below; cu128 wheels need driver >= 570). If .venv already holds a CPU
# torch, only torch is swapped. Without a GPU the normal setup runs and steps 4-5 run on the CPU;
# the GPU-only steps are reported as skipped, with the reason. With no package index (a lent GPU
# box whose python already holds a CUDA torch): GPU_CHECK_PYTHON=python3 GPU_CHECK_WHEELS=DIR
# (see the branch below; benchmarks/README.md "GPU machinery" says which wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  # A machine with no package index but a CUDA torch already installed (a lent GPU box):
  # GPU_CHECK_PYTHON names that interpreter; GPU_CHECK_WHEELS (optional) is a folder of wheels
  # (deepspeed, transformers, datasets, ... built or downloaded elsewhere) installed beside it
  # with --no-index into a scratch folder put on PYTHONPATH. The project runs from this checkout.
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L | sed 's/^/[gpu_check.sh] /'
  echo "[gpu_check.sh] using $GPU_CHECK_PYTHON ($(command -v "$GPU_CHECK_PYTHON")), no setup"
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
    "$GPU_CHECK_PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$GPU_CHECK_WHEELS"/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  python() { "$GPU_CHECK_PYTHON" "$@"; }
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check.sh] GPUs:"; nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/[gpu_check.sh]   /'
  export TORCH_SPEC=${TORCH_SPEC:-$CUDA_TORCH}
  bash scripts/setup.sh
  . .venv/bin/activate
  if [ "$(python -c 'import torch; print(torch.version.cuda is not None)')" != "True" ]; then
    echo "[gpu_check.sh] .venv holds a CPU torch; installing: $TORCH_SPEC"
    # word splitting of TORCH_SPEC is intended (a requirement plus pip options)
    # shellcheck disable=SC2086
    if ! python -m pip install -q --force-reinstall $TORCH_SPEC; then
      echo "[gpu_check.sh] could not install '$TORCH_SPEC' (no network or no such wheel); going on with" \
           "torch $(python -c 'import torch; print(torch.__version__)'): the GPU steps will say why they are skipped" >&2
    fi
  fi
else
  echo "[gpu_check.sh] no CUDA: nvidia-smi not found or sees no GPU; CPU setup, GPU steps will be skipped"
  bash scripts/setup.sh
  . .venv/bin/activate
fi

python - <<'PY'
import torch
cuda = torch.cuda.is_available()
print(f"[gpu_check.sh] torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      + (f"device {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, "
         f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if cuda else "no CUDA device visible to torch"))
PY
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${GPU_CHECK_PYTHON:-python}" benchmarks/gpu_check.py "$@"
