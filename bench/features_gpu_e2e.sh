#!/usr/bin/env bash
# Issue 11's two single-GPU targets on one H200 (bench/features_e2e.py): (A) UVA sampling with a
# 20% adjacency cache (int64 = the first layout, int32, bit-packed = the new default) vs
# device-resident vs plain UVA at 1,024 and 8,192 seeds, with the read model's served shares;
# (B) the daemon through its queue API with 20% of the feature bytes on the GPU vs all of them,
# workloads (a) and (b), and the bus bound of that ratio. First the GPU tests of the adjacency
# cache (kernel with the cache vs without vs device vs the pure-torch reference, every layout).
# About 6 minutes on one H200 (estimated, not yet run): tests cut at 70 s, the bench at 390 s
# (each daemon run at 165 s); the JSON is saved after each section, so a cut run keeps its part.
# Wheels the GPU machine lacks (pydantic, pyzmq, msgspec, pyyaml, ...) come in .whl/ (git-ignored;
# carry it). JSON: $OUT/features_e2e.json (else bench/results/features_e2e_<device>.json).
#   bash bench/features_gpu_e2e.sh [--smoke] [extra bench/features_e2e.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-$(mktemp -d -t quiver_serve_features_e2e.XXXXXX)}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
source bench/device_env.sh || exit 1
nvidia-smi -L 2>/dev/null || echo "no GPU: smoke run"

# the daemon's CPU sampler (C++) builds once per machine: start it now, beside the tests
"$PY" -c "from quiver_serve.sampling.cpu import cpp_sampler_available as a; print('C++ sampler', a())" \
    >"$LOG_DIR/cpp_build.log" 2>&1 &
build_pid=$!

echo "== GPU tests: adjacency cache bit for bit (every layout), read model (CPU) =="
timeout -k 10 70 "$PY" -m pytest --noconftest -p no:cacheprovider -q -rs \
    tests/test_adjacency_cache.py "tests/test_features_gpu.py::test_sampling_with_the_adjacency_cache_is_bit_identical" \
    2>&1 | tee "$LOG_DIR/features_e2e_tests.log" | tail -n 6
tests_rc=${PIPESTATUS[0]}
wait "$build_pid"; tail -n 1 "$LOG_DIR/cpp_build.log"

echo "== bench/features_e2e.py (tables last) =="
timeout -k 10 390 "$PY" bench/features_e2e.py ${OUT:+--out "$OUT/features_e2e.json"} "$@" 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v ' INFO \|WARNING\|proc/s\|^[[:space:]]*$' \
    | tee "$LOG_DIR/features_e2e_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "== features_gpu_e2e: tests exit $tests_rc, bench exit $bench_rc (logs in $LOG_DIR) =="
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
