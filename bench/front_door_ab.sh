#!/usr/bin/env bash
# Front-end cost, before and after, in one run: the daemon of another checkout (A) and of this
# one (B), started in turn (A, B, A, B, ...) on the same config, each measured by
# bench/bench_front_door.py (one keep-alive client, single requests; p50/p99 and front-end CPU
# per request read from /proc). Results: $OUT or bench/results/front_door_<label>_<round>.json.
#   bash bench/front_door_ab.sh OTHER_CHECKOUT [ROUNDS] [bench_front_door.py options]
#   e.g. mkdir ../qs-main; git archive main | tar -x -C ../qs-main; bash bench/front_door_ab.sh ../qs-main 2 --sizes 1
# Env: HTTP_WORKERS (default 1: the in-process front-end), PYTHON, LABEL_A/LABEL_B, CACHE_A/CACHE_B
# (QUIVER_SERVE_CACHE of each; default: the usual cache, whose C++ build directory is already
# one per checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=$(mktemp -d)
OTHER=$(cd "$1" && pwd)
ROUNDS=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
PY=${PYTHON:-python}
export QUIVER_SERVE__SERVER__HTTP_WORKERS=${HTTP_WORKERS:-1}
port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
pid=""
stop() { if [ -n "$pid" ]; then kill -TERM -- "-$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
run_one() {  # $1 checkout, $2 label, $3 build cache
    (cd "$1" && QUIVER_SERVE_CACHE=$3 exec setsid "$PY" server.py --port "$port" --log-level warning) >"$LOG_DIR/front_door_ab_$2.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || { echo "server $2 died"; tail -20 "$LOG_DIR/front_door_ab_$2.log"; exit 1; }
        sleep 0.2
    done
    shift 3
    "$PY" bench/bench_front_door.py --url "http://127.0.0.1:$port" --label "$label" "$@"
    stop
}
for r in $(seq "$ROUNDS"); do
    label="${LABEL_A:-A}_$r"; run_one "$OTHER" "$label" "${CACHE_A:-}" "$@"
    label="${LABEL_B:-B}_$r"; run_one "$PWD" "$label" "${CACHE_B:-}" "$@"
done
