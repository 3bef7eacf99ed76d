#!/usr/bin/env bash
# DeepSpeed's default multi-node runner (ssh + pdsh) on ONE machine: the README's "Moving a run to
# more machines", save on one machine, then resume over a two-host hostfile.
#
#   tests/ssh_multinode.sh WORK_DIR DS_CONFIG_1_STAGE DS_CONFIG_2_STAGES
#
# 1. needs sshd and pdsh: as root with apt-get, installs Debian's openssh-server and pdsh;
#    otherwise exits 77 (skip) with a line saying what is missing;
# 2. starts its own sshd on a spare port, listening on 127.0.0.1 and 127.0.0.2, with a throwaway
#    host key and client key (all under WORK_DIR), and an ssh config entry for both addresses
#    (WORK_DIR/ssh_config; an `ssh` wrapper first on PATH passes it: ~/.ssh is not touched);
# 3. saves on "one machine": deepspeed --num_gpus 1 ... --max_steps 4 --save_interval 2 (WORK_DIR/run);
# 4. resumes step2 over the hostfile "127.0.0.1 slots=1 / 127.0.0.2 slots=1" (2 stages) through
#    `deepspeed --hostfile` (its ssh check, then pdsh -> ssh -> each "host"), to step 4;
# 5. stops the sshd it started, by its pid (also on failure).
# Logs: WORK_DIR/save.log, WORK_DIR/resume.log, WORK_DIR/sshd.log. Exit 0 when both runs succeed.
set -euo pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 WORK_DIR DS_CONFIG_1_STAGE DS_CONFIG_2_STAGES" >&2
    exit 2
fi
work=$(mkdir -p "$1" && cd "$1" && pwd) config1=$2 config2=$3
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

skip() { echo "SKIP: $*" >&2; exit 77; }

install_tools() {
    command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || missing=1
    command -v pdsh >/dev/null || missing=1
    [ -z "${missing:-}" ] && return 0
    [ "$(id -u)" = 0 ] || skip "needs openssh-server (sshd) and pdsh: run as root with apt-get, or install them"
    command -v apt-get >/dev/null || skip "needs openssh-server (sshd) and pdsh, and there is no apt-get to install them"
    echo "installing openssh-server and pdsh (apt-get)" >&2
    apt-get update -qq >/dev/null || skip "apt-get update failed (no package registry reachable?)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server pdsh >/dev/null \
        || skip "apt-get install openssh-server pdsh failed"
}

free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_sshd() {
    local port=$1
    ssh-keygen -q -t ed25519 -N "" -f "$work/host_key"
    ssh-keygen -q -t ed25519 -N "" -f "$work/id_key"
    cp "$work/id_key.pub" "$work/authorized_keys"
    cat > "$work/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey $work/host_key
AuthorizedKeysFile $work/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile $work/sshd.pid
EOF
    cat > "$work/ssh_config" <<EOF
Host 127.0.0.1 127.0.0.2
    Port $port
    User $(id -un)
    IdentityFile $work/id_key
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile $work/known_hosts
    LogLevel ERROR
EOF
    mkdir -p "$work/bin"
    printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$work/ssh_config" > "$work/bin/ssh"
    chmod +x "$work/bin/ssh"
    [ "$(id -u)" = 0 ] && mkdir -p /run/sshd  # sshd's privilege-separation directory
    "$(command -v sshd || echo /usr/sbin/sshd)" -D -e -f "$work/sshd_config" 2> "$work/sshd.log" &
    sshd_pid=$!
    for _ in $(seq 50); do
        if PATH="$work/bin:$PATH" ssh -o BatchMode=yes 127.0.0.2 true 2>/dev/null; then
            return 0
        fi
        kill -0 "$sshd_pid" 2>/dev/null || { cat "$work/sshd.log" >&2; echo "error: sshd exited" >&2; exit 1; }
        sleep 0.2
    done
    cat "$work/sshd.log" >&2
    echo "error: cannot ssh to 127.0.0.2 through the sshd on port $port" >&2
    exit 1
}

stop_sshd() {
    if [ -n "${sshd_pid:-}" ] && kill -0 "$sshd_pid" 2>/dev/null; then
        kill "$sshd_pid"
        wait "$sshd_pid" 2>/dev/null || true
    fi
}

install_tools
trap stop_sshd EXIT
start_sshd "$(free_port)"

cd "$repo"
flags=(--eval_interval 100 --eval_batches 1 --no_save_hf --output_dir "$work/run")
# The remote ranks get only the environment DeepSpeed exports (PYTHON*, ...) and this file's lines.
# PATH too: torch builds DeepSpeed's CPU op with the first `ninja` on PATH, and another ninja (the
# system's, in a bare ssh session) rewrites the shared build cache: a ~40 s rebuild, each switch.
printf 'PATH=%s\nOMP_NUM_THREADS=1\nHF_HUB_OFFLINE=1\nHF_DATASETS_OFFLINE=1\nTOKENIZERS_PARALLELISM=false\n' \
    "$PATH" > "$work/ds_env"

# on one machine: save step 2 (and 4)
save_port=$(free_port)
OMP_NUM_THREADS=1 deepspeed --num_gpus 1 --master_port "$save_port" launch/train.py \
    --deepspeed_config "$config1" --max_steps 4 --save_interval 2 "${flags[@]}" > "$work/save.log" 2>&1 \
    || { tail -30 "$work/save.log" >&2; echo "error: the saving run failed" >&2; exit 1; }
# DeepSpeed's CPU all-reduce buffer of that one-machine launch (66 MiB of RAM; tp_trainer/ds_compat/shm.py)
rm -f "/dev/shm/deepspeed_allreduce_buffer_$(id -u)_127.0.0.1_${save_port}_"*
mv "$work/run/train_log.jsonl" "$work/save_log.jsonl"

# on two "machines": DeepSpeed's default runner, ssh + pdsh
printf '127.0.0.1 slots=1\n127.0.0.2 slots=1\n' > "$work/hosts"
PATH="$work/bin:$PATH" DS_ENV_FILE="$work/ds_env" deepspeed --hostfile "$work/hosts" --master_addr 127.0.0.1 \
    --master_port "$(free_port)" launch/train.py --deepspeed_config "$config2" --max_steps 4 --resume step2 \
    "${flags[@]}" > "$work/resume.log" 2>&1 \
    || { tail -30 "$work/resume.log" >&2; echo "error: the resume over ssh + pdsh failed" >&2; exit 1; }
echo "ok: saved on one machine, resumed over ssh + pdsh on 127.0.0.1 and 127.0.0.2"
