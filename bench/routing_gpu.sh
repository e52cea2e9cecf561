#!/usr/bin/env bash
# Routing modes (cpu, gpu, auto, torch-quiver's rule) x mixes (light, heavy, mixed 48-id requests)
# x GPU memory (device, uva) on the Reddit-scale synthetic graph. Wheels the GPU machine lacks come
# in .whl/ (git-ignored; carry it).
#   bash bench/routing_gpu.sh daemon [extra bench/bench_routing_daemon.py options]
#     the real daemon through the queue API, one daemon per (memory, mode), load processes
#     (bench/bench_routing_daemon.py): modes cpu, gpu, auto (pool overlap "hidden"), quiver, and
#     in uva also auto with pool overlap "serial" and "off" (A/B); 10 daemons, ~6-7 min on one
#     H200, cut at 470 s; daemons that would end after 400 s are skipped (the table is still
#     printed). JSON: $OUT/routing_daemon.json. The table reads seeds/s where p99 crosses 10 ms,
#     interpolated between sweep points; for a decision on one mix add e.g. `--memory uva
#     --mixes mixed --modes gpu auto quiver --repeat 3` (median of three sweeps per daemon).
#   bash bench/routing_gpu.sh [extra bench/bench_routing.py options]
#     the engine core driven directly, one 48-id batch per caller (bench/bench_routing.py);
#     ~3-6 min. JSON: $OUT/routing.json.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh || exit 1
nvidia-smi -L
if [ "${1:-}" = daemon ]; then
    shift
    BENCH=bench/bench_routing_daemon.py
    ARGS=(--memory uva device --callers 32 128 256 384 --seconds 0.8 --warmup 0.4 --procs 6
          --budget-s 400 --set sampling.num_cpu_workers=8
          --modes cpu gpu auto quiver auto:sampling.pool_overlap=serial@uva
                  auto:sampling.pool_overlap=off@uva)
else
    BENCH=bench/bench_routing.py
    ARGS=(--callers 4 16 64 --seconds 2 --samplers 8)
fi
# tqdm's progress bars end in \r: split them so the filter drops only them and INFO log lines
timeout -k 10 470 python3 "$BENCH" --config configs/bench_reddit.yaml "${ARGS[@]}" "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|node/s\|size/s\|proc/s\|^[[:space:]]*$'
rc=${PIPESTATUS[0]}
echo "$BENCH exit $rc"
exit "$rc"
