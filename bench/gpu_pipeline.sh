#!/usr/bin/env bash
# Engine core driven directly vs the daemon through its queue API (DESIGN §6), on the GPU machine:
# Reddit-scale synthetic graph, GraphSAGE [25, 10] hidden 256, workloads (a), (b), (c), one run.
# The daemon starts one engine core per GPU (inference.num_workers 0), so on a 2-GPU machine the
# same script measures 2 GPUs (the efficiency is then daemon / (2 x one engine core driven directly)).
# Wheels the GPU machine lacks (pydantic, pyzmq, msgspec, ...) come in .whl/ (git-ignored; carry it).
# About 3 minutes on one H200 (170 s on 2026-11-22); the run is cut at 470 s.
# JSON: $OUT/pipeline_gpu<N>.json when OUT is set, else bench/results/pipeline_<device>x<N>_reddit-s1.json.
#   bash bench/gpu_pipeline.sh [extra bench/bench_pipeline.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh || exit 1
nvidia-smi -L
GPUS=$(nvidia-smi -L | grep -c '^GPU')
echo "GPUs: $GPUS"
OUT_JSON=${OUT:+$OUT/pipeline_gpu$GPUS.json}
# tqdm's progress bars end in \r: split them so the filter drops only them and INFO log lines
timeout -k 10 470 python3 bench/bench_pipeline.py --config configs/bench_reddit.yaml \
    --workloads a b c --seconds 4 --warmup 1 --engine-seconds 2 \
    --callers 16 64 256 1024 --callers-c 1 16 64 ${OUT_JSON:+--out "$OUT_JSON"} "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|proc/s\|^[[:space:]]*$'
rc=${PIPESTATUS[0]}
echo "bench_pipeline.py exit $rc"
exit "$rc"
