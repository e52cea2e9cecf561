"""The model-reload bench (``bench.models.reload``): the recorder's per-request windows, the swap
figures read from them, the engine cores' load lines, the GPU suite's steps, and a smoke run
against the real daemon on Cora (version 2 loaded under load, no request failed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.models import reload_report
from loadtest.recorder import CLIENT_OVERLOAD, NO_VERSION, TIMEOUT, Records

REPO_ROOT = Path(__file__).resolve().parents[2]


def records(rows: list[tuple[float, float, int, int]], win0: float = 0.0,
            win1: float = 10.0) -> Records:
    """Records of (scheduled, done, status, version) rows."""
    sched, done, status, version = (np.array(c) for c in zip(*rows, strict=True))
    return Records(sched.astype(np.float64), done.astype(np.float64), status.astype(np.int32),
                   version.astype(np.int32), win0, win1)


def test_a_window_counts_requests_by_schedule_and_latency_from_it() -> None:
    r = records([(0.5, 0.51, 200, 1), (1.0, 1.02, 200, 1), (1.5, 1.6, 503, NO_VERSION),
                 (2.0, 2.03, 200, 2), (2.5, np.nan, TIMEOUT, NO_VERSION),
                 (3.0, np.nan, CLIENT_OVERLOAD, NO_VERSION), (9.0, 9.001, 200, 2)])
    w = r.window(1.0, 3.5)
    assert (w["requests"], w["ok"], w["failed"]) == (5, 2, 3)
    assert w["statuses"] == {"200": 2, "503": 1, "timeout": 1, "client_overload": 1}
    assert w["versions"] == {"1": 1, "2": 1} and w["req_per_s"] == pytest.approx(2 / 2.5)
    assert w["p50_ms"] == pytest.approx(25.0) and w["from_s"] == 1.0
    assert r.failed() == 3 and list(r.answers(2)) == [2.03, 9.001]


def test_merge_orders_every_process_request_by_schedule() -> None:
    def part(index: int, sched: list[float], version: int) -> dict:
        n = len(sched)
        return {"index": index, "sched": np.array(sched), "done": np.array(sched) + 0.01,
                "status": np.full(n, 200, np.int32), "version": np.full(n, version, np.int32),
                "cpu_frac": 0.1 * (index + 1), "conn_errors": {"ClientOSError": index}}

    r = Records.merge([part(1, [0.2, 0.4], 2), part(0, [0.1, 0.3], 1)], 0.0, 1.0)
    assert list(r.sched) == [0.1, 0.2, 0.3, 0.4] and list(r.version) == [1, 2, 1, 2]
    assert r.cpu_cores == [0.1, 0.2] and r.conn_errors == {"ClientOSError": 1}


def test_swap_figures_from_the_call_to_the_first_answer_of_the_new_version() -> None:
    rows = [(t / 10, t / 10 + 0.01, 200, 1 if t < 53 else 2) for t in range(100)]
    rows[20] = (2.0, np.nan, CLIENT_OVERLOAD, NO_VERSION)
    r = records(rows)
    call = {"t_call": 5.0, "t_answer": 5.2, "status": 200, "answer": {}, "write_s": 0.01}
    out = reload_report.reload_figures(r, call, swap_s=1.0, steady={"p99_ms": 5.0})
    assert out["first_new_answer_s"] == pytest.approx(0.31)
    assert out["last_old_answer_s"] == pytest.approx(0.21)
    assert out["load_call"]["wall_s"] == pytest.approx(0.2) and out["failed_run"] == 1
    w = out["windows"]
    assert w["swap"]["from_s"] == 5.0 and w["swap"]["seconds"] == pytest.approx(1.31)
    assert w["before"]["failed"] == 1 and w["swap"]["versions"] == {"1": 3, "2": 11}
    assert w["after"]["versions"] == {"2": 36} and out["swap_window_closed"]
    assert out["p99_swap_over_steady"] == pytest.approx(2.0)  # 10 ms over 5 ms
    only_old = records([(t / 10, t / 10 + 0.01, 200, 1) for t in range(100)])
    missed = reload_report.reload_figures(only_old, call, swap_s=1.0, steady=None)
    assert missed["first_new_answer_s"] is None and missed["windows"]["after"] is None
    assert not missed["swap_window_closed"]
    no_call = reload_report.reload_figures(r, {}, 1.0, None)
    assert no_call["windows"] == {} and no_call["load_call"]["wall_s"] is None


def test_targets_need_no_failure_a_prompt_first_answer_and_a_bounded_p99() -> None:
    steady = {"failed_run": 0}
    met = reload_report.targets(steady, {"failed_run": 0, "first_new_answer_s": 1.5,
                                         "p99_swap_over_steady": 1.9}, 2.0, 2.0)
    assert met["no_failures"] and met["first_new_answer_met"] and met["p99_met"]
    missed = reload_report.targets(steady, {"failed_run": 3, "first_new_answer_s": 2.5,
                                            "p99_swap_over_steady": 2.1}, 2.0, 2.0)
    assert missed["failed"] == 3 and missed["no_failures"] is False
    assert missed["first_new_answer_met"] is False and missed["p99_met"] is False
    unmeasured = reload_report.targets(steady, None, 2.0, 2.0)
    assert unmeasured["no_failures"] is None and unmeasured["p99_met"] is None


def test_engine_load_lines_are_read_from_the_daemon_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("x INFO engine 0: sage version 1 serving (load {'build_s': 0.1})\n"
                   "x INFO engine 1: sage version 2 serving (load {'build_s': 0.2, "
                   "'cuda_graphs_s': 0.5})\nnoise\n")
    rows = reload_report.serving_lines(log)
    assert rows[1] == {"engine": 1, "model": "sage", "version": 2,
                       "load_s": {"build_s": 0.2, "cuda_graphs_s": 0.5}}
    assert reload_report.serving_lines(tmp_path / "none.log") == []


def test_the_gpu_suite_runs_the_bench_into_the_output_folder(tmp_path: Path) -> None:
    import importlib.util

    from bench.gpu.__main__ import parse_args
    from bench.gpu.suites import MAIN_BENCH, SUITES

    a = parse_args(["reload", "--smoke", "--out-dir", str(tmp_path), "--machine", "h200"])
    a.out_dir = tmp_path
    steps = SUITES["reload"](a)
    bench = steps[-1]
    assert steps[0].argv == ["nvidia-smi", "-L"] and bench.timeout_s == 560.0
    assert bench.argv[2] == MAIN_BENCH["reload"] == "bench.models.reload"
    assert importlib.util.find_spec(bench.argv[2]) and bench.argv[-1] == "--smoke"
    assert bench.result is not None and bench.result.parent == tmp_path
    assert bench.result.name.startswith("reload_h200_") and bench.result.name.endswith("_smoke.json")


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_loads_the_new_version_under_load_without_a_failed_request(
        tmp_path: Path) -> None:
    """``--smoke``: Cora on the CPU, the real daemon serving a repository, the load generator's
    processes for the capacity, the recorder for the open loop; version 2 written and loaded
    while the load runs; it answers, no request fails, the JSON has every figure."""
    out = tmp_path / "reload.json"
    proc = subprocess.run([sys.executable, "-m", "bench.models.reload", "--smoke", "--out",
                           str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not res["skipped"], res["skipped"]
    assert res["meta"]["command"].startswith("python -m bench.models.reload --smoke")
    assert res["meta"]["git_head"] and res["meta"]["machine"] and res["meta"]["config"]
    assert res["capacity"]["req_per_s"] > 0 and res["capacity_points"]
    steady, rel = res["steady"], res["reload"]
    assert steady["failed_run"] == 0 and steady["ok"] > 0
    assert steady["versions"] == {"1": steady["ok"]}
    assert steady["p99_ms"] > 0
    assert rel["load_call"]["status"] == 200 and rel["load_call"]["wall_s"] > 0
    assert rel["failed_run"] == 0 and rel["statuses_run"] == {"200": rel["statuses_run"]["200"]}
    assert rel["first_new_answer_s"] is not None and rel["first_new_answer_s"] > 0
    w = rel["windows"]
    assert w["before"]["versions"] == {"1": w["before"]["ok"]} and w["swap"]["versions"]["2"] > 0
    for name in ("before", "swap"):
        assert w[name]["p99_ms"] > 0 and w[name]["p999_ms"] >= w[name]["p99_ms"]
    assert rel["p99_swap_over_steady"] > 0
    assert any(e["version"] == 2 for e in rel["engines"]), rel["engines"]
    states = {row["version"]: row["state"] for row in rel["index_after"]}
    assert states == {"1": "UNAVAILABLE", "2": "READY"}, rel["index_after"]
    t = res["targets"]
    assert t["failed"] == 0 and t["no_failures"] is True
    assert set(t) >= {"first_new_answer_met", "p99_met", "p99_swap_over_steady"}
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| reload: ")
