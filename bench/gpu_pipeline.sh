#!/usr/bin/env bash
# Engine core vs daemon (queue API) on the GPU machine, workloads (a), (b), (c) of DESIGN §6.
# One engine core per GPU is started automatically, so the same script measures 1 or 2 GPUs.
# Wheels the GPU box lacks (pydantic, pyzmq, msgspec, ...) come in .whl/ (git-ignored; see the
# device README). Results: $OUT/pipeline_gpu<N>.json when OUT is set.
#   bash bench/gpu_pipeline.sh [extra bench_engine_vs_daemon.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
GPUS=$(nvidia-smi -L | wc -l)
echo "GPUs: $GPUS"
OUT_JSON=${OUT:+$OUT/pipeline_gpu$GPUS.json}
"$PY" bench/bench_engine_vs_daemon.py --config configs/bench_reddit.yaml ${OUT_JSON:+--out "$OUT_JSON"} "$@" \
    2>&1 | grep -v " INFO \|proc/s"
