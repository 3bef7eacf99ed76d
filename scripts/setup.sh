#!/usr/bin/env bash
# One-time (idempotent) setup: .venv with the pinned torch, the project and its test tools, and
# DeepSpeed's two JIT ops the trainer and tests load prebuilt: the CPU communication op and FusedAdam
# (~40 s each on 2 cores; minutes on a loaded machine). Built here, that time stays out of the test
# suite's. They are built under .venv/torch_extensions: torch's default cache (~/.cache/torch_extensions)
# is one folder per op for every venv, and its build files name the venv's include paths, so a second
# checkout with its own venv rebuilt them there, and the first rebuilt them again on its next run,
# inside a rank or a test.
# TORCH_SPEC picks another torch (default torch==2.13.0: the CPU build on this machine's disk;
# on a CUDA machine e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128").
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  PY=$(command -v python3.11 || command -v python3)
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# every python of this venv (the launcher's ranks, tests, benchmarks) builds and loads its JIT ops under
# .venv/torch_extensions unless TORCH_EXTENSIONS_DIR says otherwise: a .pth line runs at start-up
purelib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import os, sys; os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))' \
  > "$purelib/tp_trainer_torch_extensions.pth"
ops_dir=$(python -c 'import os; print(os.environ["TORCH_EXTENSIONS_DIR"])')
# A DeepSpeed op build killed midway leaves torch's lock file behind, and every later build or load
# of that op then waits on it forever; a real build takes under 4 minutes.
find "$ops_dir" -name lock -mmin +15 -delete 2>/dev/null || true
stamp=".venv/.tp_trainer-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
  python -m pip install -q $TORCH_SPEC
  python -m pip install -q -e ".[test]"
  python - <<'PY'
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.torch import build_shm_op
build_shm_op()
get_accelerator().create_op_builder("FusedAdamBuilder").load()
PY
  touch "$stamp"
fi
