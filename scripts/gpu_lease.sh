#!/usr/bin/env bash
# What a lent GPU runs first, in one device call (run from the repository root there, wheels carried
# in .whl as scripts/gpu_wheels.sh makes them): gpu_check --quick (the slice step, engine step and peak
# memory; DEADLINE s, default 300, then ~40 s of report), then the planner step (--steps autoplan, cut
# at 200 s), then the wavefront probe (--steps wavefront, cut at 90 s). Reports under OUT/gc, OUT/ap
# and OUT/wf; prints their summaries.
#   bash scripts/gpu_lease.sh OUT [DEADLINE]
# GPU_CHECK_PYTHON (default python3: the image's CUDA torch) and GPU_CHECK_WHEELS (default .whl) as
# gpu_check.sh reads them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_lease.sh OUT [DEADLINE]}
mkdir -p "$out"
export GPU_CHECK_PYTHON=${GPU_CHECK_PYTHON:-python3} GPU_CHECK_WHEELS=${GPU_CHECK_WHEELS-.whl}
bash scripts/gpu_check.sh --quick --deadline "${2:-300}" --out "$out/gc" > "$out/quick.log" 2>&1
echo "[gpu_lease] quick: rc=$?"
timeout 200 bash scripts/gpu_check.sh --steps autoplan --out "$out/ap" > "$out/autoplan.log" 2>&1
echo "[gpu_lease] autoplan: rc=$?"
timeout 90 bash scripts/gpu_check.sh --steps wavefront --out "$out/wf" > "$out/wavefront.log" 2>&1
echo "[gpu_lease] wavefront: rc=$?"
grep -v "^- \|^$" "$out/quick.log" | tail -45
[ -f "$out/ap/autoplan.md" ] && cat "$out/ap/autoplan.md" || tail -20 "$out/autoplan.log"
[ -f "$out/wf/wavefront.md" ] && cat "$out/wf/wavefront.md" || tail -20 "$out/wavefront.log"
