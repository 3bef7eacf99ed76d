#!/usr/bin/env bash
# Set up (once) and run the main job: gpt2-tiny, 2 pipeline stages on 2 CPU ranks, embedded corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
rc=0
deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/gpt2_tiny_cpu.json "$@" || rc=$?
# DeepSpeed's CPU all-reduce leaves its shared-memory buffers in /dev/shm (~66 MiB a rank; named as
# tp_trainer/ds_compat/shm.py says, with the launcher's defaults: 127.0.0.1, port 29500)
rm -f /dev/shm/deepspeed_allreduce_buffer_"$(id -u)"_127.0.0.1_29500_[0-9]*
exit $rc
