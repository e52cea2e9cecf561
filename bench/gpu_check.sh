#!/usr/bin/env bash
# The GPU gate: the GPU tests (samplers, engine core, CUDA graphs, fast model), the GPU sampler
# benchmark, the engine-core stage profile (bench/profile_engine.py), the model-compute benchmark
# (bench/bench_model.py) and the engine-vs-daemon benchmark.
# Run on a CUDA machine from the repository root:   bash bench/gpu_check.sh [bench options]
#
# Only the GPU test files run: tests/conftest.py and most other tests import the server stack
# (pydantic, fastapi), which GPU boxes may lack, so pytest runs with --noconftest; the GPU test
# files import only dependency-free modules. Logs (and bench_gpu.json) go to $OUT, else to a
# fresh temporary folder (named at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-$(mktemp -d -t quiver_serve_gpu_check.XXXXXX)}
mkdir -p "$LOG_DIR"

# The serving pipeline tests need pydantic, which GPU boxes may lack: carry wheels in .whl/
# (git-ignored; see the device README) and they are installed here, outside the system packages.
source bench/device_env.sh || exit 1

echo "== GPU tests =="
# Outer timeouts because a hung kernel blocks in C, where pytest-timeout cannot interrupt it.
timeout "${GPU_TEST_TIMEOUT_S:-600}" "$PY" -m pytest --noconftest -p no:cacheprovider -m gpu \
    -q -rs tests/test_*gpu*.py 2>&1 | tee "$LOG_DIR/gpu_tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}
# The engine core's CUDA tests use the shared fixtures (pydantic comes from the carried wheels).
timeout "${GPU_TEST_TIMEOUT_S:-600}" "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs \
    tests/test_engine_core.py tests/test_graphed.py tests/test_fast_model.py tests/test_overlap.py 2>&1 | tee "$LOG_DIR/gpu_core_tests.log" | tail -n 5
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1

echo "== GPU benchmark =="
timeout "${GPU_BENCH_TIMEOUT_S:-900}" "$PY" bench/bench_gpu_sampler.py --json "$LOG_DIR/bench_gpu.json" "$@" \
    2>&1 | tee "$LOG_DIR/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}

echo "== Engine core: time per stage and batch size (eager vs CUDA graphs) =="
timeout "${GPU_BENCH_TIMEOUT_S:-900}" "$PY" bench/profile_engine.py --config configs/bench_reddit.yaml \
    --out "$LOG_DIR/profile_engine.json" 2>&1 | grep -v ' INFO \|WARNING' | tee "$LOG_DIR/profile_engine.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1

echo "== Model compute per batch: PyG's layers vs the fast path, by class and precision =="
timeout "${GPU_BENCH_TIMEOUT_S:-900}" "$PY" bench/bench_model.py --config configs/bench_reddit.yaml \
    --out "$LOG_DIR/bench_model.json" 2>&1 | grep -v ' INFO \|WARNING\|weights is null\|adj = \|invariant' \
    | tee "$LOG_DIR/bench_model.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1

echo "== Engine core vs daemon through the queue API (Reddit-scale; table last) =="
timeout "${GPU_BENCH_TIMEOUT_S:-900}" "$PY" bench/bench_pipeline.py --config configs/bench_reddit.yaml \
    --out "$LOG_DIR/pipeline_gpu.json" ${PIPELINE_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v ' INFO \|proc/s\|^[[:space:]]*$' \
    | tee "$LOG_DIR/pipeline_gpu.log"
serving_rc=${PIPESTATUS[0]}

echo "== gpu_check: tests exit ${tests_rc}, sampler benchmark exit ${bench_rc}, pipeline benchmark exit ${serving_rc} (logs in ${LOG_DIR}) =="
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$serving_rc" -eq 0 ]
