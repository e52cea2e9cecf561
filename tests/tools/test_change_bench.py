"""The change bench (``bench.graph.change``): its window figures (ratios to the steady window,
time until answers come again after a kill, the longest stretch without an answer, the
per-stage histograms over a window, the issue's targets), the GPU suite's steps, and a smoke
run against the real daemon on Cora."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.graph import change_report as report

REPO_ROOT = Path(__file__).resolve().parents[2]


def embed(p99_ms: float | None, failed: int = 0, statuses: dict | None = None) -> dict:
    return {"req_per_s": 100.0, "requests": 200, "p50_ms": 1.0, "p99_ms": p99_ms,
            "p999_ms": p99_ms, "failed": failed, "statuses": statuses or {"200": 200}}


def seen(stale_p99_ms: float | None = None) -> dict:
    return {"metrics": {"staleness": {"p50_ms": 1.0, "p99_ms": stale_p99_ms, "count": 5}},
            "staleness_polled_ms": {"p50": None, "p99": None, "max": None}, "graph": {}}


def test_ratio_to_the_steady_window_is_missing_without_a_positive_base() -> None:
    assert report.ratio(12.0, 8.0) == 1.5
    assert report.ratio(None, 8.0) is None and report.ratio(3.0, None) is None
    assert report.ratio(3.0, 0.0) is None


def test_answers_again_counts_only_requests_sent_after_the_kill() -> None:
    sched = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    done = np.array([0.5, 9.0, 7.0, 6.5, np.nan])
    ok = np.array([True, True, False, True, False])
    # the request sent at 1.0 was answered at 9.0, but it was sent before the kill at 1.5; the
    # one sent at 2.0 failed; the one sent at 3.0 answered at 6.5
    assert report.answers_again_after_s(sched, done, ok, 1.5) == pytest.approx(5.0)
    assert report.answers_again_after_s(sched, done, ok, 3.5) is None


def test_longest_gap_includes_the_window_ends() -> None:
    done = np.array([1.0, 1.5, 5.0, 5.2, np.nan, 20.0])
    ok = np.array([True, True, True, True, False, True])
    assert report.longest_gap_s(done, ok, 0.0, 6.0) == pytest.approx(3.5)  # 1.5 -> 5.0
    assert report.longest_gap_s(done, ok, 0.0, 12.0) == pytest.approx(6.8)  # 5.2 -> the end
    assert report.longest_gap_s(done, ~ok, 0.0, 4.0) == pytest.approx(4.0)  # no answer at all


def test_window_row_compares_p99_to_steady_and_counts_5xx() -> None:
    upd = {"target_edges_per_s": 100.0, "acked_edges_per_s": 90.0, "call_p50_ms": 2.0,
           "call_p99_ms": 20.0, "call_max_ms": 30.0, "status": {"200": 9, "503": 1}}
    row = report.window_row("updates 100/s", embed(15.0, 3, {"200": 197, "503": 2, "timeout": 1}),
                            upd, seen(40.0), 10.0)
    assert row["p99_over_steady"] == 1.5 and row["embed_5xx"] == 2 and row["embed_failed"] == 3
    assert row["update_errors"] == {"503": 1} and row["update_max_ms"] == 30.0
    assert row["staleness_p99_ms"] == 40.0
    quiet = report.window_row("steady", embed(10.0), None, seen(), None)
    assert quiet["p99_over_steady"] is None and quiet["target_edges_per_s"] == 0.0
    assert quiet["updater"] is None and "|" in report.row_line(quiet)


def test_targets_judge_the_highest_rate_the_compaction_and_the_model_load() -> None:
    upd = {"target_edges_per_s": 0.0, "call_p99_ms": 50.0, "status": {}}
    rows = [report.window_row("steady", embed(6.0), None, seen(), 6.0)]
    for rate, p99, stale in ((10_000.0, 20.0, 500.0), (100_000.0, 8.0, 60.0)):
        r = report.window_row(f"updates {rate:g}/s", embed(p99), {**upd,
                              "target_edges_per_s": rate}, seen(stale), 6.0)
        rows.append(r)
    comp = report.window_row("compaction", embed(12.0), {**upd, "call_p99_ms": 90.0,
                                                         "call_max_ms": 150.0}, seen(), 6.0)
    load = report.window_row("model load", embed(7.0, failed=1), None, seen(), 6.0)
    load["model_load"] = {"first_new_answer_s": 0.4}
    t = report.targets([*rows, comp, load])
    assert t["updates 100000/s"] == {"p99_ratio_met": True, "embed_p99_met": True,
                                     "staleness_p99_met": True, "update_p99_met": True}
    assert "updates 10000/s" not in t
    assert t["compaction"] == {"p99_ratio_met": False, "update_p99_met": True,
                               "update_max_met": False}
    assert t["model load"] == {"p99_ratio_met": True, "no_failures": False,
                               "first_answer_met": True}
    assert "MISSED" in report.targets_line(t) and report.targets_line({}).endswith("none measured")


def hist_text(name: str, labels: str, counts: list[int], total_s: float) -> str:
    les = ["0.001", "0.01", "+Inf"]
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels}le="{le}"}} {c}' for le, c in zip(les, counts, strict=True)]
    lines += [f"{name}_count{{{labels.rstrip(',')}}} {counts[-1]}",
              f"{name}_sum{{{labels.rstrip(',')}}} {total_s}"]
    return "\n".join(lines) + "\n"


def test_stage_histograms_keep_the_named_families_that_observed_in_the_window() -> None:
    g, other = "quiver_serve_graph_apply_seconds", "quiver_serve_http_other_seconds"
    before = hist_text(g, 'stage="read",', [0, 0, 0], 0.0) + hist_text(other, "", [1, 1, 1], 1.0)
    after = hist_text(g, 'stage="read",', [0, 4, 4], 0.02) + hist_text(other, "", [1, 2, 2], 2.0)
    out = report.stage_histograms(before, after)
    assert list(out) == [f"{g}{{stage=read}}"]
    h = out[f"{g}{{stage=read}}"]
    assert h["count"] == 4 and h["mean_ms"] == pytest.approx(5.0)
    assert 1.0 <= h["p50_ms"] <= 10.0
    assert report.stage_histograms(None, after) == {}


def test_the_gpu_suite_runs_the_bench_with_the_issue_settings(tmp_path: Path) -> None:
    import importlib.util

    from bench.gpu.__main__ import parse_args
    from bench.gpu.suites import SUITES

    a = parse_args(["change", "--out-dir", str(tmp_path), "--machine", "h200",
                    "--budget-s", "300"])
    a.out_dir = tmp_path
    bench = SUITES["change"](a)[-1]
    assert bench.argv[2] == "bench.graph.change" and importlib.util.find_spec(bench.argv[2])
    argv = bench.argv
    assert "graph.fsync=group" in argv and argv[argv.index("--edges-per-call") + 1] == "2000"
    assert argv[-2:] == ["--budget-s", "300"]  # the suite's option comes last: it wins
    assert bench.result.parent == tmp_path and bench.result.name.startswith("change_h200_")


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_measures_every_window_against_steady(tmp_path: Path) -> None:
    """``--smoke``: Cora on the CPU, the real daemon with a model repository, load, updater
    processes; every window measured, version 2 answers after the load call, the compaction
    ends, the killed engine core answers again, the JSON written."""
    out = tmp_path / "change.json"
    proc = subprocess.run([sys.executable, "-m", "bench.graph.change", "--smoke", "--out",
                           str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    rows = {r["window"]: r for r in res["rows"]}
    assert list(rows)[0] == "steady" and not res["skipped"], res["skipped"]
    assert len([w for w in rows if w.startswith("updates")]) == 3
    for name, row in rows.items():
        assert row["embed_req_per_s"] > 0 and row["p99_over_steady"] is not None, name
        if name != "engine kill -9":
            assert row["embed_5xx"] == 0, row
        if name.startswith("updates"):
            assert row["acked_edges_per_s"] > 0 and row["update_errors"] == {}, row
            assert any(k.startswith("quiver_serve_graph_") for k in row["stages"])
    load = rows["model load"]["model_load"]
    assert load["load_call"]["status"] == 200 and load["first_new_answer_s"] is not None
    assert rows["compaction"]["compaction"]["duration_s"] is not None
    kill = rows["engine kill -9"]["kill"]
    assert kill["ready_after_s"] is not None and kill["answers_again_after_s"] is not None
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| engine kill -9 |")
