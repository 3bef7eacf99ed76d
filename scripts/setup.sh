#!/usr/bin/env bash
# One-time (idempotent) setup: .venv with the pinned torch, the project and its test tools, and
# DeepSpeed's two JIT ops the trainer and tests load prebuilt: the CPU communication op and FusedAdam
# (built side by side; minutes on a loaded machine). Built here, that time stays out of the test
# suite's. They are built under .venv/torch_extensions: torch's default cache (~/.cache/torch_extensions)
# is one folder per op for every venv, and its build files name the venv's include paths, so a second
# checkout with its own venv rebuilt them there, and the first rebuilt them again on its next run,
# inside a rank or a test.
# Packages go in with uv (installed into the venv by pip; it resolves, downloads and builds in parallel)
# given the index, find-links, constraint and certificate settings of pip's configuration (uv reads
# none of pip's); where uv cannot be installed, with pip itself.
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

# pip's settings (its config files and PIP_* variables, as `pip config list` shows them, the
# highest-precedence one of each key) as uv options; the certificate file as SSL_CERT_FILE
uv_options() {
  python -m pip config list 2>/dev/null | python -c '
import shlex, sys
rank = {":env:": 3, "site": 2, "user": 1, "global": 0}   # pip: variables over site over user over global files
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
best = {}
for line in sys.stdin:
    name, _, value = line.strip().partition("=")
    section, _, key = name.rpartition(".")
    order = (rank.get(section, 0), 0 if section in rank else 1)  # an [install] section over [global]
    if key and (key not in best or order >= best[key][0]):
        best[key] = (order, shlex.split(value)[0] if value else "")
options = [part for key, flag in flags.items() if key in best for item in best[key][1].split()
           for part in (flag, item)]
if best.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
    options.append("--no-index")
if "cert" in best:
    print("export SSL_CERT_FILE=" + shlex.quote(best["cert"][1]))
print("UV_PIP_OPTIONS=(" + " ".join(shlex.quote(o) for o in options) + ")")
'
}

UV_PIP_OPTIONS=()
install() {   # install REQUIREMENTS... with uv where it could be installed (pip where uv fails), else with pip
  if [ -x .venv/bin/uv ]; then
    # unsafe-best-match: the best version over every index, as pip picks (uv's default: the first index's)
    uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "${UV_PIP_OPTIONS[@]}" "$@" && return
    echo "setup.sh: uv failed to install $*; trying pip" >&2
  fi
  python -m pip install -q "$@"
}

compile_bytecode() {   # every installed module's .pyc, and the project's, written once here
  # Without them (uv installs none; PYTHONDONTWRITEBYTECODE, where set, stops Python writing them at
  # import) every Python process compiles torch, transformers, DeepSpeed and datasets from source
  # again: ~6 s of each rank's start on this machine (import of the run: 10.3 s, 4.8 s with them).
  # A file compileall cannot read (a package's template, say) is skipped: its exit status is not ours.
  python -m compileall -q -j 0 "$purelib" tp_trainer launch tests benchmarks > /dev/null || true
}

build_ops() {   # the two ops, side by side (each is two C++ files; the longer file sets the time)
  python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' &
  local shm=$!
  python -c 'from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder("FusedAdamBuilder").load()' &
  local adam=$! status=0
  wait "$shm" || status=$?
  wait "$adam" || status=$?
  return "$status"
}

stamp=".venv/.tp_trainer-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  if python -m pip install -q uv; then
    eval "$(uv_options)"
  else
    echo "setup.sh: uv could not be installed; installing with pip" >&2
    python -m pip install -q --upgrade pip
  fi
  # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
  # (word splitting of TORCH_SPEC is intended: a requirement plus installer options)
  install $TORCH_SPEC
  install -e ".[test]"
  compile_bytecode
  build_ops
  touch "$stamp"
fi
