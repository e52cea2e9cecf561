"""The exact-table bench (``bench.graph.exact_table``): the load generator's exact requests, the
table figures read from the daemon (build, counters, polled freshness), the targets, the GPU
suite's steps, and a smoke run against the real daemon on Cora."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.graph import exact_report, table_watch

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_exact_requests_carry_the_flag_and_plain_ones_are_unchanged() -> None:
    from loadtest.protocols import encode_http

    ids = np.array([3, 4])
    for protocol in ("http-json", "http-npy"):
        assert json.loads(encode_http(protocol, ids)[0]) == {"node_ids": [3, 4]}
        assert json.loads(encode_http(protocol, ids, exact=True)[0]) == {
            "node_ids": [3, 4], "exact": True}
    kserve = json.loads(encode_http("kserve-json", ids, exact=True)[0])
    assert kserve["parameters"] == {"exact": True}
    assert "parameters" not in json.loads(encode_http("kserve-json", ids)[0])
    body, headers = encode_http("kserve-binary", ids, exact=True)
    head = json.loads(body[:int(headers["Inference-Header-Content-Length"])])
    assert head["parameters"] == {"exact": True}


def test_build_is_read_from_the_graph_route_else_metrics_else_the_log() -> None:
    log = ("... exact table: 2708 nodes x [128, 64] in gpu memory (2.7 MiB), built in 0.05 s\n"
           "... exact table: 2708 nodes x [128, 64] in gpu memory (2.7 MiB), built in 0.07 s\n")
    from_log = table_watch.build_info({"engines": [{"exact_table": None}]}, None, log)
    assert from_log["build_s"] == 0.07 and from_log["source"] == "log"
    assert from_log["nodes"] == 2708 and from_log["dims"] == [128, 64]
    assert from_log["where"] == "gpu" and from_log["engines"] == 2
    metrics = ('quiver_serve_exact_table_build_seconds{engine="0"} 0.5\n'
               'quiver_serve_exact_table_bytes{engine="0"} 1048576.0\n')
    from_metrics = table_watch.build_info({}, metrics, log)
    assert from_metrics["build_s"] == 0.5 and from_metrics["source"] == "/metrics"
    graph = {"exact_table": {"build_s": 1.25, "bytes": 2**20, "where": "host"}}
    from_graph = table_watch.build_info(graph, metrics, "")
    assert from_graph["build_s"] == 1.25 and from_graph["source"] == "GET /v1/graph"
    assert table_watch.build_info(None, None, "")["build_s"] is None


def test_counters_over_a_window_by_source() -> None:
    def text(table: float, fly: float, rows: float) -> str:
        return ("# TYPE quiver_serve_exact_requests_total counter\n"
                f'quiver_serve_exact_requests_total{{engine="0",source="table"}} {table}\n'
                f'quiver_serve_exact_requests_total{{engine="0",source="on_the_fly"}} {fly}\n'
                "# TYPE quiver_serve_exact_table_rows_refreshed_total counter\n"
                f'quiver_serve_exact_table_rows_refreshed_total{{engine="0"}} {rows}\n')

    c = table_watch.counters_window(text(5, 1, 100), text(25, 4, 600), seconds=2.0)
    assert (c["from_table"], c["on_the_fly"], c["rows_refreshed"]) == (20, 3, 500)
    assert c["rows_refreshed_per_s"] == 250
    assert table_watch.counters_window(None, text(1, 1, 1), 1.0)["from_table"] is None
    assert table_watch.counters_window("# nothing\n", "# nothing\n", 1.0)["on_the_fly"] is None


def test_polled_freshness_lag_and_time_behind() -> None:
    def poll(t: float, acked: int, table: int) -> dict:
        return {"t": t, "version": acked, "engines": [{"engine": 0, "version": acked,
                "exact_table": {"version": table, "stale_rows": acked - table,
                                "last_round_staleness_s": 0.01}}]}

    polls = [poll(0.0, 1, 1), poll(0.1, 3, 1), poll(0.2, 4, 1), poll(0.3, 4, 4)]
    f = table_watch.polled_freshness(polls + [{"t": 0.4, "version": 4, "engines": [{}]}])
    assert f["polls"] == 4 and f["version_lag"]["max"] == 3
    assert f["behind_ms"]["max"] == pytest.approx(100.0)  # behind since the poll at 0.1 s
    assert f["last_round_staleness_ms"]["p50"] == pytest.approx(10.0)


def test_targets_compare_exact_with_sampled_at_the_bound() -> None:
    def series(mode: str, request: str, under: float | None, most: float) -> dict:
        point = {"level": 1, "req_per_s": most, "p50_ms": 1.0}
        return {"mode": mode, "protocol": "http-npy", "request": request, "points": [point],
                "under_bound": None if under is None else {"req_per_s": under},
                "most": {"req_per_s": most}}

    t = exact_report.targets([series("table", "exact", 900.0, 1000.0),
                              series("table", "sampled", None, 300.0),
                              series("on_the_fly", "exact", None, 10.0)], 10.0)["http-npy"]
    assert t["meets_target"] is True and t["sampled_req_per_s"] == 0.0
    assert t["table_over_on_the_fly_most"] == 100.0
    lost = exact_report.targets([series("table", "exact", None, 5.0),
                                 series("table", "sampled", 50.0, 60.0)], 10.0)["http-npy"]
    assert lost["meets_target"] is False and lost["on_the_fly_req_per_s_at_bound"] is None


def test_the_gpu_suite_runs_the_bench_into_the_output_folder(tmp_path: Path) -> None:
    import importlib.util

    from bench.gpu.__main__ import parse_args
    from bench.gpu.suites import MAIN_BENCH, SUITES

    a = parse_args(["exact", "--smoke", "--out-dir", str(tmp_path), "--machine", "h100"])
    a.out_dir = tmp_path
    steps = SUITES["exact"](a)
    bench = steps[-1]
    assert steps[0].argv == ["nvidia-smi", "-L"] and bench.timeout_s == 560.0
    assert bench.argv[2] == MAIN_BENCH["exact"] == "bench.graph.exact_table"
    assert importlib.util.find_spec(bench.argv[2]) and bench.argv[-1] == "--smoke"
    assert bench.result is not None and bench.result.parent == tmp_path
    assert bench.result.name.startswith("exact_table_h100_")
    assert bench.result.name.endswith("_smoke.json")


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_serves_exact_requests_from_the_table_and_on_the_fly(tmp_path: Path) -> None:
    """``--smoke``: Cora on the CPU, the real daemons (table on, then off) over HTTP npy and the
    queue API, the load generator's processes; every serving series measured, exact answers from
    the table without 5xx, the build and the refresh step reported, the JSON written."""
    out = tmp_path / "exact_table.json"
    proc = subprocess.run([sys.executable, "-m", "bench.graph.exact_table", "--smoke", "--out",
                           str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not res["skipped"], res["skipped"]
    series = {(s["mode"], s["protocol"], s["request"]): s for s in res["series"]}
    for mode in ("table", "on_the_fly"):
        for protocol in ("http-npy", "queue"):
            s = series[(mode, protocol, "exact")]
            assert s["points"] and all(p["req_per_s"] > 0 for p in s["points"]), s
    for protocol in ("http-npy", "queue"):
        table = series[("table", protocol, "exact")]
        assert all(table_watch.fivexx(p["errors"]) == 0 for p in table["points"]), table
        assert table["counters"]["from_table"] > 0 and table["counters"]["on_the_fly"] == 0
        assert series[("table", protocol, "sampled")]["points"]
    build = res["builds"][0]
    assert build["build_s"] is not None and build["nodes"] == 2708, build
    assert [r["exact_offered_req_per_s"] for r in res["refresh"]] == [0.0, 10.0]
    for refresh in res["refresh"]:
        assert refresh["acked_edges_per_s"] > 0 and refresh["update_5xx"] == 0, refresh
        assert refresh["sampled_req_per_s"] > 0 and refresh["rows_refreshed"] > 0, refresh
        assert refresh["exact_failed"] is None
    assert res["refresh"][1]["exact_req_per_s"] > 0
    assert res["targets"]["http-npy"]["table_over_on_the_fly_most"] is not None
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| ")
