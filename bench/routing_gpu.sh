#!/usr/bin/env bash
# Routing modes (cpu, gpu, auto, torch-quiver's rule) x mixes (light, heavy, mixed 48-id batches)
# x GPU memory (device, uva) on the Reddit-scale synthetic graph, engine core direct with a real
# CPU sampler pool (bench/bench_routing.py). Wheels the GPU machine lacks come in .whl/ (carry it).
# Expected ~6 min on one H200; cut at 470 s. JSON: $OUT/routing.json.
#   bash bench/routing_gpu.sh [extra bench/bench_routing.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    && export PYTHONPATH="$SITE:$PWD" || exit 1
nvidia-smi -L
timeout -k 10 470 python3 bench/bench_routing.py --config configs/bench_reddit.yaml \
    --callers 4 16 64 --seconds 2 --samplers 8 "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|node/s\|size/s\|^[[:space:]]*$'
rc=${PIPESTATUS[0]}
echo "bench_routing.py exit $rc"
exit "$rc"
