#!/usr/bin/env bash
# The headline benchmark on the GPU machine (bench/headline.py): Reddit-scale synthetic graph built
# once and saved as .npz, quiver-serve with sampling.route auto, cpu and gpu in turn, the queue API
# and the PyG-style baseline (bench/baseline_server.py), closed-loop sweeps over HTTP JSON, HTTP npy,
# KServe binary, gRPC and the queue API, workload (a), plus single-id HTTP p50 (workload c).
# Writes $OUT/headline.json, $OUT/headline_throughput_vs_p99.png, $OUT/headline_latency_cdf.png,
# $OUT/headline.log; prints the table last. Budget: phases that would start after 460 s are
# skipped (and named); the run is cut at 520 s (SIGTERM: what was measured is still written).
# Wheels the GPU machine lacks (fastapi, uvicorn, pydantic, pyzmq, msgspec, orjson, ...) come in
# .whl/ (git-ignored; carry it); aiohttp and matplotlib are in the machine's image.
#   bash bench/headline_gpu.sh [extra bench/headline.py options]
#   bash bench/headline_gpu.sh --smoke      # Cora, CPU routes: the same code path in ~2 minutes
#   bash bench/headline_gpu.sh --single-only --routes auto --seconds 5
#                                           # single-id HTTP p50 only, fast_routes on/off (~2-3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
source bench/device_env.sh || exit 1
"$PY" -c "import fastapi, uvicorn, pydantic, zmq, msgspec, orjson, aiohttp, matplotlib, grpc" || {
    echo "missing Python packages: carry them as wheels in .whl/ (see the device README)"; exit 1; }
"$PY" -c "import uvloop, httptools" 2>/dev/null || echo "WARNING: uvloop or httptools missing: \
uvicorn runs on asyncio/h11, every HTTP request costs more CPU (carry their wheels in .whl/)"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi: CPU only"
OUT_DIR=${OUT:-bench/results}
mkdir -p "$OUT_DIR"
# tqdm's progress bars end in \r: split them so the filter drops only them and INFO log lines
timeout -k 30 520 "$PY" bench/headline.py --out "$OUT_DIR" --budget-s 460 "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|proc/s\|^[[:space:]]*$' | tee "$OUT_DIR/headline.log"
rc=${PIPESTATUS[0]}
echo "headline.py exit $rc"
exit "$rc"
