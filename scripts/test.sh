#!/usr/bin/env bash
# Set up (once) and run the whole test suite (no network, no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# two workers (pytest-xdist); the tests that share a wide fixture (a multi-rank launch, often) stay on
# one worker (tests/xdist_groups.py). Later options win: `-n 0` runs in this process.
exec python -m pytest -q -n 2 --dist loadgroup "$@"
