#!/usr/bin/env bash
# Set up (once) and run the main job: gpt2-tiny, 2 pipeline stages on 2 CPU ranks, embedded corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/gpt2_tiny_cpu.json "$@"
