#!/usr/bin/env bash
# Start this machine's part of a multi-node tp_trainer job, without ssh.
#
#   launch/multinode.sh HOSTFILE NODE_RANK MASTER_ADDR [launch/train.py flags...]
#
# Run it once on every node listed in HOSTFILE (same repository path and environment everywhere),
# each with its own NODE_RANK (0 = the first host line, 1 = the second, ...) and the same
# MASTER_ADDR (an address of node 0 that every node can reach) and MASTER_PORT (env, default 29500).
# It checks HOSTFILE first (python -m tp_trainer.hostfile: one clear error naming the line and the
# fix, exit 2), then runs
#
#   deepspeed --hostfile HOSTFILE --no_ssh --node_rank NODE_RANK --master_addr MASTER_ADDR \
#             --master_port ${MASTER_PORT:-29500} [$DEEPSPEED_ARGS] launch/train.py [flags...]
#
# Each invocation starts the ranks of its own host only (RANK, LOCAL_RANK, WORLD_SIZE = sum of all
# slots, MASTER_ADDR/PORT are set by DeepSpeed's launcher); the job starts when every node has joined.
# Rank 0 (node 0) writes --output_dir/train_log.jsonl and plan.json. Do not pass --num_gpus or
# --num_nodes: with a hostfile they override the slots / drop hosts (see launch/hostfile.example).
# DEEPSPEED_ARGS (env): extra launcher options, e.g. "--include worker-0:0,1@worker-1:0,1".
#
# Example: two "nodes" on one machine (launch/hostfile.example), a 2-stage pipeline:
#   launch/multinode.sh launch/hostfile.example 0 127.0.0.1 --deepspeed_config ds_configs/gpt2_tiny_cpu.json &
#   launch/multinode.sh launch/hostfile.example 1 127.0.0.1 --deepspeed_config ds_configs/gpt2_tiny_cpu.json
#
# With passwordless ssh (and pdsh installed) instead, run ONE command on the first node; DeepSpeed
# ssh-checks the first host, then starts every node through pdsh (cd to this same path, same python):
#   deepspeed --hostfile hosts launch/train.py --deepspeed_config ds_configs/<name>.json [flags...]
# (add --master_addr to skip its `ssh <first host> hostname -I` lookup; environment variables reach
# the other nodes only if named PYTHON*, UCX*, ... or listed in ./.deepspeed_env as KEY=VALUE lines).
# Check the hostfile first there too: deepspeed treats a MISSING hostfile as "this machine only"
# with just a warning.  For gloo on machines with several interfaces, set GLOO_SOCKET_IFNAME.
set -euo pipefail

usage="usage: $0 HOSTFILE NODE_RANK MASTER_ADDR [launch/train.py flags...]"
if [ $# -lt 3 ]; then
    echo "$usage" >&2
    exit 2
fi
hostfile=$1 node_rank=$2 master_addr=$3
shift 3
if ! [[ $node_rank =~ ^[0-9]+$ ]]; then
    echo "error: NODE_RANK must be a whole number >= 0 (the line of this host in $hostfile), got '$node_rank'" >&2
    echo "$usage" >&2
    exit 2
fi
if [ -z "$master_addr" ]; then
    echo "error: MASTER_ADDR is empty; pass an address of node 0 that every node can reach" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python}
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m tp_trainer.hostfile "$hostfile" --node_rank "$node_rank" || exit 2

# shellcheck disable=SC2086  # DEEPSPEED_ARGS is a list of launcher options
exec deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$node_rank" --master_addr "$master_addr" \
    --master_port "${MASTER_PORT:-29500}" ${DEEPSPEED_ARGS:-} "$repo/launch/train.py" "$@"
