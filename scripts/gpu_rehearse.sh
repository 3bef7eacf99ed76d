#!/usr/bin/env bash
# Rehearse a lent GPU machine's run here, on the CPU, before spending its minutes: the same Python
# (3.12) and torch (2.11.0, the image's) as there, the same carried wheels (.whl, scripts/gpu_wheels.sh)
# installed the same way (GPU_CHECK_PYTHON / GPU_CHECK_WHEELS), then gpu_check.sh --quick (the CPU
# block sets, compiled with inductor; the CUDA-only variants are not run) and the tests of the slice
# path's CPU parts.
# What it cannot catch: anything that only CUDA runs (graph capture, flash / cuDNN kernels, NCCL).
#   bash scripts/gpu_rehearse.sh [gpu_check flags]      # e.g. --compile off
# REHEARSE_TORCH (default 2.11.0) and REHEARSE_PYTHON (default: pyenv's 3.12) pick the pair; the
# venv is .rehearse/ (ignored by git, ~5 GB: PyPI's torch for Linux is the CUDA build; the first
# setup takes about a minute here), the report goes to .rehearse/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${REHEARSE_TORCH:-2.11.0}
py=${REHEARSE_PYTHON:-}
if [ -z "$py" ]; then
  for candidate in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys' 2>/dev/null; then py=$candidate; break; fi
  done
fi
if [ -z "$py" ]; then
  echo "error: no Python 3.12 found (the lent machine runs 3.12); set REHEARSE_PYTHON to one" >&2
  exit 2
fi
# a new torch version or a change to this script (its package list) makes the venv again
stamp=".rehearse/.torch-$torch_version-$(sha1sum < scripts/gpu_rehearse.sh | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  rm -rf .rehearse
  "$py" -m venv .rehearse
  .rehearse/bin/python -m pip install -q --upgrade pip
  # torch as the image has it, and the image's packages gpu_check imports that .whl does not carry
  # (versions from the image's pip list, where known)
  .rehearse/bin/python -m pip install -q "torch==$torch_version" numpy==2.5.2 huggingface_hub==1.33.0 \
    safetensors==0.8.0 tokenizers==0.23.2 pyyaml packaging psutil py-cpuinfo tqdm einops msgpack ninja \
    pyarrow pandas xxhash requests httpx aiohttp matplotlib pytest
  touch "$stamp"
fi
[ -d .whl ] || bash scripts/gpu_wheels.sh
export GPU_CHECK_PYTHON=$PWD/.rehearse/bin/python GPU_CHECK_WHEELS=.whl GPU_CHECK_SITE=$PWD/.rehearse/site
# the compiled variants through inductor as on the GPU (its C++ backend here; aot_eager is the CPU's default)
export GPU_CHECK_COMPILE_BACKEND=${GPU_CHECK_COMPILE_BACKEND:-inductor}
rm -rf "$GPU_CHECK_SITE"
bash scripts/gpu_check.sh --quick --deadline 360 --out .rehearse/gpu_check "$@"
# gpu_check records a failing part in its report and goes on (a lent GPU's minutes are not lost to it):
# here any such record fails the rehearsal
"$GPU_CHECK_PYTHON" - <<'PY'
import json, sys
report = json.load(open(".rehearse/gpu_check/gpu_check.json"))
problems = [f"errors: {k}" for k in report.get("errors", {})]
problems += [f"engine step: {k}" for k in (report.get("engine_step") or {}).get("errors", {})]
problems += [f"exactness failed: {k}" for k, v in report.get("exactness", {}).items() if not v["passed"]]
problems += [f"not run: {what}" for what in report.get("not_run", [])]
if not report.get("slice_cost"):
    problems.append("no slice_cost records")
if problems:
    sys.exit("error: the rehearsal's gpu_check report has " + "; ".join(problems))
env = report["environment"]
if not str(env.get("cudnn_frontend") or "")[:1].isdigit():   # the bottom-right kernel's package, bound to torch's libcudnn
    sys.exit(f"error: the cuDNN frontend did not load under the lent machine's torch: {env.get('cudnn_frontend')}")
print(f"[gpu_rehearse] gpu_check under Python {env['python']}, torch {env['torch']}: "
      f"{len(report['slice_cost'])} slice_cost records, exactness passed, no errors; "
      f"cuDNN frontend {env['cudnn_frontend']}")
PY
# the CPU parts of the slice path (attention over the cache, capture bookkeeping, compile) under that torch
PYTHONPATH="$GPU_CHECK_SITE:$PWD" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  "$GPU_CHECK_PYTHON" -m pytest -q -p no:cacheprovider tests/test_attention_cuda.py tests/test_attention_cudnn.py tests/test_gpu_attention_time.py tests/test_gpu_wavefront.py \
  tests/test_capture.py tests/test_captured_blocks.py tests/test_compiled_blocks.py tests/test_slice_attention.py \
  tests/test_slice_cache.py tests/test_slice_compile.py tests/test_shared_attention.py tests/test_weight_grad.py
echo "[gpu_rehearse] passed; report: .rehearse/gpu_check/"
