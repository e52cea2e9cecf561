#!/usr/bin/env bash
# Feature store and adjacency cache on one GPU (issue 11): the GPU tests of the gather kernel,
# the adjacency cache, the samplers and the engine core with the store, then
# bench/bench_features.py (Reddit- and ogbn-products-scale synthetic graphs at full scale).
# About 5-6 minutes on one H200 (estimated, not yet run; tests cut at 120 s, the bench at 330 s;
# the bench saves its JSON after each section, so a cut run keeps what it measured).
# Wheels the GPU machine lacks (pydantic, pyzmq, msgspec, ...) come in .whl/ (git-ignored; carry it).
# JSON: $OUT/features_gpu.json (else bench/results/features_cuda.json); logs in $OUT.
# The plot is drawn afterwards, where matplotlib is: python bench/plot_features.py JSON PNG
#   bash bench/features_gpu.sh [extra bench/bench_features.py options, e.g. --products-scale 0.5]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-$(mktemp -d -t quiver_serve_features.XXXXXX)}
mkdir -p "$LOG_DIR"
source bench/device_env.sh || exit 1
nvidia-smi -L

echo "== GPU tests: gather kernel, adjacency cache, samplers (bit for bit), engine core =="
timeout -k 10 120 python3 -m pytest --noconftest -p no:cacheprovider -m gpu -q -rs \
    tests/test_features_gpu.py tests/test_sampler_gpu.py 2>&1 | tee "$LOG_DIR/features_gpu_tests.log" | tail -n 8
tests_rc=${PIPESTATUS[0]}
# the engine core's and CUDA graphs' GPU tests gather through the store (shared fixtures: pydantic)
timeout -k 10 100 python3 -m pytest -p no:cacheprovider -m gpu -q -rs \
    tests/test_engine_core.py tests/test_graphed.py 2>&1 | tee "$LOG_DIR/features_core_tests.log" | tail -n 5
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1

echo "== bench/bench_features.py (table last) =="
timeout -k 10 330 python3 bench/bench_features.py ${OUT:+--out "$OUT/features_gpu.json"} "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|WARNING\|^[[:space:]]*$' | tee "$LOG_DIR/features_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "== features_gpu: tests exit $tests_rc, bench exit $bench_rc (logs in $LOG_DIR) =="
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
