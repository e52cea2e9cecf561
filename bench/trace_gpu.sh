#!/usr/bin/env bash
# One small request through the queue API on the GPU machine, stage by stage: where the single-id
# p50 goes (issue 8's <= 1 ms target). Reddit-scale graph (configs/bench_reddit.yaml), routes
# auto / local (C++ sampler in the engine) / gpu, sync and asyncio callers; then the
# bench_pipeline single-id point (load processes) for comparison with earlier figures.
# Run from the repository root on a CUDA machine:  bash bench/trace_gpu.sh
# (carry .whl/ for pyzmq, msgspec, pydantic...; smoke run on a dev box:
#  NO_WHEELS=1 PYTHON=.venv/bin/python SCALE=0.005 REQUESTS=300 bash bench/trace_gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-$(mktemp -d -t quiver_serve_trace.XXXXXX)}
mkdir -p "$LOG_DIR"
source bench/device_env.sh || exit 1
SCALE_ARG=()
[ -n "${SCALE:-}" ] && SCALE_ARG=(--scale "$SCALE")
rc=0
for route in ${ROUTES:-auto local gpu}; do
    echo "== route $route =="
    timeout "${TRACE_TIMEOUT_S:-200}" "$PY" bench/trace_latency.py --config configs/bench_reddit.yaml \
        --route "$route" --requests "${REQUESTS:-2000}" "${SCALE_ARG[@]}" \
        --out "$LOG_DIR/trace_$route.json" 2>&1 | grep -v ' INFO \|WARNING' | tail -n 26
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
echo "== single id from load processes (bench_pipeline, workload c, 1 caller) =="
timeout "${TRACE_TIMEOUT_S:-200}" "$PY" bench/bench_pipeline.py --config configs/bench_reddit.yaml \
    --workloads c --callers-c 1 --batch-sizes-c 1 --seconds 3 --warmup 1 "${SCALE_ARG[@]}" \
    --out "$LOG_DIR/single_id.json" 2>&1 | tr '\r' '\n' | grep -v ' INFO \|proc/s\|^[[:space:]]*$' | tail -n 6
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== trace_gpu: exit $rc (JSON in $LOG_DIR) =="
exit $rc
