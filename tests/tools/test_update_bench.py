"""The update bench (``bench.graph.updates``): its updater's calls (adds by degree, removals of
its own acknowledged adds), the graph metrics read over a window, the GPU suite's steps, and a
smoke run against the real daemon on Cora."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadtest import updater, watch

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_adds_draw_dst_by_in_degree_and_src_uniformly() -> None:
    indptr = np.array([0, 0, 0, 90, 100])  # node 2 has 90 in-edges, node 3 has 10, 0 and 1 none
    rng = np.random.default_rng(0)
    biased = updater.draw_adds(rng, 20_000, 4, indptr, degree_bias=1.0)
    assert biased.shape == (20_000, 2) and biased.dtype == np.int64
    counts = np.bincount(biased[:, 1], minlength=4)
    assert counts[0] == counts[1] == 0 and 0.85 < counts[2] / counts.sum() < 0.95
    assert np.bincount(biased[:, 0], minlength=4).min() > 4000  # sources uniform
    plain = updater.draw_adds(rng, 20_000, 4, indptr, degree_bias=0.0)
    assert np.bincount(plain[:, 1], minlength=4).min() > 4000


def test_removals_take_the_oldest_acknowledged_adds_first() -> None:
    r = updater.Removals()
    r.push(np.array([[0, 1], [0, 2]]))
    r.push(np.empty((0, 2), np.int64))
    r.push(np.array([[3, 4], [5, 6], [7, 8]]))
    assert r.take(3).tolist() == [[0, 1], [0, 2], [3, 4]]
    assert r.size == 2
    assert r.take(10).tolist() == [[5, 6], [7, 8]]
    assert r.take(1).shape == (0, 2) and r.size == 0


def test_a_call_body_is_the_edges_route_json() -> None:
    body = json.loads(updater.encode(np.array([[1, 2], [3, 4]]), np.array([[5, 6]])))
    assert body == {"add": [[1, 2], [3, 4]], "remove": [[5, 6]]}
    empty = json.loads(updater.encode(np.empty((0, 2), np.int64), np.empty((0, 2), np.int64)))
    assert empty == {"add": [], "remove": []}


def test_schedule_spreads_the_calls_over_the_processes() -> None:
    cmd = {"rate": 10_000.0, "edges_per_call": 1000, "t_start": 100.0, "warm_s": 1.0,
           "seconds": 2.0, "procs": 2}
    a, b = updater.schedule(cmd, 0), updater.schedule(cmd, 1)
    both = np.sort(np.concatenate([a, b]))
    assert both.size == 30 and np.allclose(np.diff(both), 0.1)  # 10 calls/s for 3 s
    assert a[0] == 100.0 and b[0] == pytest.approx(100.1)


def test_merge_counts_acknowledged_edges_per_second() -> None:
    part = updater.Tally()
    part.record("200", 0.010, 0.0, 1000, {"added": 900, "removed": 100, "missing": 0,
                                          "version": 7})
    part.record("503", 0.001, 0.0, 1000, {})
    other = updater.Tally()
    other.record("200", 0.030, 0.002, 1000, {"added": 900, "removed": 100, "version": 9})
    merged = updater.merge([part.result(0, 0.1), other.result(1, 0.2)],
                           {"rate": 1500.0, "edges_per_call": 1000, "seconds": 2.0})
    assert merged["acked_edges_per_s"] == 1000.0 and merged["calls"] == 3
    assert merged["status"] == {"200": 2, "503": 1} and merged["last_version"] == 9
    assert (merged["added"], merged["removed"], merged["missing"]) == (1800, 200, 0)
    assert merged["call_p50_ms"] == pytest.approx(20.0)


def test_graph_metrics_over_a_window() -> None:
    """Text written by prometheus_client: the staleness histogram, embed answers by status and
    the compaction counter, differenced between two scrapes."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    stale = Histogram(watch.STALENESS, "s", buckets=(0.001, 0.01, 0.1, 1.0), registry=reg)
    req = Histogram(watch.REQUEST_DURATION, "r", ["endpoint", "status"],
                    buckets=(0.001, 0.01, 0.1), registry=reg)
    compactions = Counter("quiver_serve_graph_compactions_total", "c", registry=reg)
    stale.observe(0.5)
    req.labels("/v1/embed", "200").observe(0.002)
    before = generate_latest(reg).decode()
    for v in (0.002, 0.003, 0.004, 0.05):
        stale.observe(v)
    for _ in range(3):
        req.labels("/v1/embed", "200").observe(0.005)
    req.labels("/v1/embed", "503").observe(0.0005)
    req.labels("/v1/graph/edges", "200").observe(0.02)
    compactions.inc()
    m = watch.metrics_window(before, generate_latest(reg).decode())
    assert m["staleness"]["count"] == 4 and 1.0 <= m["staleness"]["p50_ms"] <= 10.0
    assert m["embed_server"]["count"] == 3 and m["edges_server"]["count"] == 1
    assert m["embed_statuses"] == {"200": 3, "503": 1}
    assert m["counters"] == {"quiver_serve_graph_compactions_total": 1.0}
    assert watch.metrics_window(None, before) == {}


def test_the_gpu_suite_runs_the_bench_into_the_output_folder(tmp_path: Path) -> None:
    import importlib.util

    from bench.gpu.__main__ import parse_args
    from bench.gpu.suites import SUITES

    a = parse_args(["updates", "--smoke", "--out-dir", str(tmp_path), "--machine", "h200"])
    a.out_dir = tmp_path
    steps = SUITES["updates"](a)
    bench = steps[-1]
    assert bench.argv[2] == "bench.graph.updates" and importlib.util.find_spec(bench.argv[2])
    assert bench.argv[-1] == "--smoke" and bench.result is not None
    assert bench.result.parent == tmp_path and bench.result.name.startswith("updates_h200_")
    assert bench.result.name.endswith("_smoke.json")


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_updates_the_graph_under_load(tmp_path: Path) -> None:
    """``--smoke``: Cora on the CPU, the real daemon, load and updater processes; every step's
    updates acknowledged, removals hit, staleness measured, no 5xx, the JSON written."""
    out = tmp_path / "updates.json"
    proc = subprocess.run([sys.executable, "-m", "bench.graph.updates", "--smoke", "--out",
                           str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    steps = [r["step"] for r in res["rows"]]
    assert steps[0] == "no updates" and len([s for s in steps if s.startswith("updates")]) == 2
    assert res["capacity"]["req_per_s"] > 0 and not res["skipped"], res["skipped"]
    version = 0
    for row in res["rows"]:
        assert row["embed_5xx"] == 0 and row["embed_req_per_s"] > 0, row
        if row["step"] == "no updates":
            continue
        upd = row["updater"]
        assert upd["calls_ok"] == upd["calls"] > 0 and row["update_5xx"] == 0, upd
        assert upd["missing"] == 0 and upd["removed"] > 0 and row["acked_edges_per_s"] > 0
        assert row["staleness_count"] > 0 or row["staleness_polled_ms"]["max"] is not None
        assert upd["last_version"] > version and row["graph_after"]["version"] > version
        version = upd["last_version"]
    compaction = res["compaction"]
    assert compaction["offered"] and compaction["duration_s"] is not None, compaction
    assert res["rows"][-1]["compactions"] >= 1
    assert proc.stdout.rstrip().splitlines()[-1].startswith("compaction:")


class StubGraphDaemon:
    """The graph routes of the contract, answered by a thread: edges calls recorded and
    acknowledged, ``GET /v1/graph`` with one engine a version behind, a compaction that ends
    ``compaction_s`` after it is asked for."""

    def __init__(self, compaction_s: float = 0.3) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stub = self
        self.version, self.calls, self.last_compaction = 0, [], None
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return None

            def answer(self, status: int, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/v1/graph/edges":
                    with stub.lock:
                        stub.version += 1
                        stub.calls.append(body)
                        self.answer(200, {"version": stub.version, "added": len(body["add"]),
                                          "removed": len(body["remove"]), "missing": 0})
                elif self.path == "/v1/graph/compact":
                    threading.Timer(compaction_s, stub.compacted).start()
                    self.answer(202, {"accepted": True})
                else:
                    self.answer(404, {"error": {"code": "not_found", "message": self.path}})

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/graph":
                    v = stub.version
                    self.answer(200, {"version": v, "engines": [
                        {"engine": 0, "version": max(v - 1, 0), "staleness_s": 0.002}],
                        "num_nodes": 10, "num_edges": 5, "overlay": {"entries_used": 1},
                        "last_compaction": stub.last_compaction})
                else:
                    self.answer(404, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def compacted(self) -> None:
        self.last_compaction = {"version": self.version, "seconds": 0.3}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_updater_posts_at_its_rate_and_removes_only_what_was_acknowledged() -> None:
    import asyncio
    import time

    stub = StubGraphDaemon()
    try:
        cmd = {"url": stub.url, "rate": 4000.0, "edges_per_call": 100, "remove_fraction": 0.2,
               "degree_bias": 0.5, "num_nodes": 50, "indptr": np.arange(51) * 2, "seed": 1,
               "t_start": time.time() + 0.05, "warm_s": 0.2, "seconds": 1.0, "inflight": 16,
               "timeout_s": 5.0, "procs": 1}
        res = updater.merge([asyncio.run(updater.run_updates(0, cmd))], cmd)
    finally:
        stub.close()
    # 40 calls/s: 40 scheduled in the window, sent unless 16 were in flight (a slow box)
    assert res["calls"] + res["skipped"] == 40 and res["calls_ok"] == res["calls"] >= 30
    assert res["acked_edges_per_s"] == 100 * res["calls_ok"]
    added: list[list[int]] = []
    for body in stub.calls:
        assert len(body["add"]) + len(body["remove"]) == 100
        assert all(p in added for p in body["remove"])  # earlier acknowledged adds only
        added += body["add"]
    removes = [len(b["remove"]) for b in stub.calls]  # 20 once earlier calls are answered
    assert removes[0] == 0 and max(removes) == 20


def test_watch_polls_versions_and_a_forced_compaction_ends() -> None:
    import time

    stub = StubGraphDaemon(compaction_s=0.3)
    try:
        stub.version = 5
        w = watch.Watch(stub.url, interval_s=0.05)
        now = time.time()
        w.start(now, now + 0.4)
        seen = w.result()
        forced = watch.force_compaction(stub.url, timeout_s=5.0, poll_s=0.05)
        missing = watch.force_compaction(stub.url + "/nope", timeout_s=5.0)
    finally:
        stub.close()
    assert seen["polls"] >= 4 and seen["version_lag"]["max"] == 1.0
    assert seen["staleness_polled_ms"]["p99"] == pytest.approx(2.0)
    assert seen["graph"]["version"] == 5 and seen["metrics"] == {}  # no /metrics on the stub
    assert forced["offered"] and forced["status"] == 202 and 0.25 <= forced["duration_s"] < 2
    assert forced["last_compaction"] == {"version": 5, "seconds": 0.3}
    assert missing["offered"] is False
