#!/usr/bin/env python
"""Serving through change (docs/architecture.md, "The living graph", "Models and versions"):
embed latency at a fixed load while the graph, the model and the processes change, window by
window, against a steady window of the same run.

One daemon (``server.py``, the graph of --config saved once as an .npz) serving a model
repository (model ``sage``, version 1; ``bench/models/reload.py``) with
``server.standby_processes: 0`` (a killed engine core restarts from a fresh interpreter).
Workload (b) (48 ids uniform over every node, HTTP npy) from the load generator's processes
(``loadtest/``), every request recorded (``loadtest/recorder.py``):

1. capacity: closed-loop callers doubling until p99 passes --stop-p99-ms; capacity = the most
   req/s at p99 <= --capacity-bound-ms (0: the most req/s of any point);
2. open loop (Poisson) at --load-fraction of it, windows in turn: steady (nothing changes);
   edge updates at each --update-rates (updater processes, ``loadtest/updater.py``); a model load
   (version 2 written into the repository and ``POST /v2/repository/models/sage/load`` called
   --event-at-s into the window: the call's time, the first answer of version 2, the swap
   window); a forced compaction (``POST /v1/graph/compact``) with updates at --compaction-rate;
   kill -9 of an engine core (time until it is alive, ready, and answering again; the longest
   stretch without an answer).

Per window: embed p50 / p99 / p99.9, served req/s, failed (5xx), p99 / steady p99; update call
p50 / p99 / max and acknowledged edge updates/s; staleness p50 / p99 (the daemon's histogram)
and polled; the ``quiver_serve_graph_*``, ``quiver_serve_exact_*`` and engine histograms over
the window (where time goes). Budgeted (--budget-s): a window that would start past it is
skipped and named. The JSON goes to --out, else --out-dir (default $OUT, else bench/results/) as
change_<machine>_<date>[_<variant>].json; a table is printed last.

    python -m bench.graph.change                     # Reddit-scale, configs/bench_reddit.yaml
    python -m bench.graph.change --smoke             # Cora on a CPU box, a few minutes
    python -m bench.gpu change                       # the GPU runner's suite
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.graph import change_report as report
from bench.graph import updates
from bench.models import reload
from bench.models.reload_report import reload_figures, serving_lines
from loadtest import faults, results, watch
from loadtest.cpu_use import CpuMeter
from loadtest.gen import Generator, add_capacity_options
from loadtest.harness import Daemon, Session, saved_graph_facts, serve_config
from loadtest.recorder import OK, RecorderPool
from loadtest.stats import capacity_text
from loadtest.updater import add_updater_options

SERVER_GRACE_S = 8.0
EVENTS = ("updates", "model", "compaction", "kill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = results.doc_parser("python -m bench.graph.change", __doc__)
    results.add_run_options(ap, budget_s=440.0, start_timeout_s=600.0)
    add_capacity_options(ap, [16, 32, 64, 128, 256, 512])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window of each step")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--load-req-per-s", type=float, default=0.0,
                    help="open-loop req/s of every window (0: --load-fraction of the capacity); "
                         "a fixed load compares settings across runs")
    ap.add_argument("--events", nargs="+", default=list(EVENTS), choices=EVENTS,
                    help="the windows after the steady one, in this order")
    ap.add_argument("--update-rates", type=float, nargs="+", default=[10_000, 50_000, 100_000],
                    help="edge updates/s, one window each")
    add_updater_options(ap)
    ap.add_argument("--compaction-rate", type=float, default=10_000,
                    help="edge updates/s during the compaction window")
    ap.add_argument("--compaction-seconds", type=float, default=20.0)
    ap.add_argument("--compaction-timeout-s", type=float, default=180.0)
    ap.add_argument("--event-at-s", type=float, default=2.0,
                    help="seconds into a window the load call or the kill comes")
    ap.add_argument("--model-seconds", type=float, default=12.0)
    ap.add_argument("--swap-s", type=float, default=1.0,
                    help="the swap window ends this long after the first new-version answer")
    ap.add_argument("--load-config", help="JSON of the load call's parameters.config")
    ap.add_argument("--load-timeout-s", type=float, default=120.0)
    ap.add_argument("--kill-seconds", type=float, default=30.0,
                    help="measured window of the kill (the restart and answers after it)")
    ap.add_argument("--restart-timeout-s", type=float, default=120.0)
    ap.add_argument("--admin-token", help="server.admin_token, sent as the bearer token")
    ap.add_argument("--poll-interval-s", type=float, default=0.1)
    ap.set_defaults(protocol="http-npy")  # the recorder's protocol; capacity is measured on it
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args)
    return args


def smoke(args: argparse.Namespace) -> None:
    """Cora, small rates and short windows; the pure-torch sampler (no C++ build in the time)."""
    results.smoke_settings(args, budget_s=240.0)
    args.capacity_callers, args.capacity_seconds = [1, 2, 4], 0.8
    args.seconds, args.warmup, args.compaction_seconds = 3.0, 0.5, 4.0
    args.update_rates, args.compaction_rate = [500.0, 1000.0, 2000.0], 500.0
    args.edges_per_call, args.update_procs = 100, 1
    args.model_seconds, args.event_at_s, args.kill_seconds = 5.0, 1.0, 15.0
    args.compaction_timeout_s = min(args.compaction_timeout_s, 30.0)
    args.load_fraction = min(args.load_fraction, 0.5)  # a 2-core box runs daemon and load alike


class Run(updates.Run):
    """The update bench's run state (load, updaters, capacity) with the daemon, the recording
    load processes and the model repository."""

    def __init__(self, args: argparse.Namespace, daemon: Daemon, gen: Generator,
                 rec: RecorderPool, updaters: Any, facts: dict, t0: float) -> None:
        super().__init__(args, daemon.url, gen, updaters, facts, t0)
        self.daemon, self.rec = daemon, rec
        self.steady_p99_ms: float | None = None
        self.steady: dict[str, Any] | None = None

    def rate(self) -> float:
        a = self.args
        return a.load_req_per_s or a.load_fraction * self.capacity["req_per_s"]


def window(run: Run, name: str, seconds: float, rate: float = 0.0,
           event: Callable[[float], None] | None = None) -> tuple[dict[str, Any], Any]:
    """One open-loop window at the run's rate, the daemon watched, updaters at ``rate`` (0:
    none); ``event(win0)`` called on its own thread at the window's start. The row and the
    records."""
    a = run.args
    w = watch.Watch(run.url, run.headers, a.poll_interval_s)
    meter = CpuMeter(run.url, run.headers, run.daemon.proc.pid)
    threads: list[threading.Thread] = []

    def on_start(t_start: float) -> None:
        win0 = t_start + a.warmup
        if rate > 0:
            run.updaters.start(run.update_cmd(rate, t_start, seconds))
        w.start(win0, win0 + seconds)
        timer = threading.Timer(max(0.0, win0 - time.time()), meter.mark)
        timer.daemon = True
        timer.start()
        if event is not None:
            threads.append(threading.Thread(target=event, args=(win0,), daemon=True))
            threads[0].start()

    print(f"\n== {name}: embed {run.rate():,.0f} req/s open loop, edge updates {rate:,.0f}/s, "
          f"{seconds:g} s ==", flush=True)
    recs = run.rec.run(run.url, run.spec, run.rate(), a.warmup, seconds, a.timeout_s, on_start)
    cores = meter.cores()  # where the machine's CPU went in the window (the load's tail too)
    upd = run.updaters.collect() if rate > 0 else None
    for t in threads:
        t.join(timeout=max(a.compaction_timeout_s, a.load_timeout_s, a.restart_timeout_s) + 30)
    seen = w.result()
    row = report.window_row(name, recs.window(recs.win0, recs.win1), upd, seen,
                            run.steady_p99_ms)
    texts = w.texts + [None] * (2 - len(w.texts))
    row["stages"] = report.stage_histograms(texts[0], texts[-1])
    row["cpu_cores"] = cores
    if cores:
        print("cores used: " + ", ".join(f"{k} {v:g}" for k, v in cores.items()), flush=True)
    run.rows.append(row)
    return row, recs


def steady_window(run: Run) -> None:
    row, _ = window(run, "steady", run.args.seconds)
    run.steady_p99_ms = row["embed_p99_ms"]
    row["p99_over_steady"] = 1.0 if row["embed_p99_ms"] else None
    run.steady = {"p99_ms": row["embed_p99_ms"]}
    print(report.row_line(row), flush=True)


def update_windows(run: Run) -> None:
    for rate in run.args.update_rates:
        if not run.afford(f"updates {rate:g}/s", run.step_cost_s(run.args.seconds)):
            return
        row, _ = window(run, f"updates {rate:g}/s", run.args.seconds, rate)
        print(report.row_line(row), flush=True)
        if (row["updater"] or {}).get("calls_ok", 0) == 0:
            run.skipped.append(f"higher update rates: no call answered 200 at {rate:g}/s "
                               f"({row['update_errors']})")
            print(f"SKIPPED {run.skipped[-1]}", flush=True)
            return


def model_window(run: Run) -> None:
    """Version 2 written and loaded --event-at-s into the window (``bench.models.reload``)."""
    a, call = run.args, {}

    def event(win0: float) -> None:
        reload.load_at(run, win0 + a.event_at_s, call)

    row, recs = window(run, "model load", a.model_seconds, event=event)
    row["model_load"] = reload_figures(recs, call, a.swap_s, run.steady)
    row["model_load"]["engines"] = serving_lines(run.daemon.log_path)
    print(report.row_line(row), flush=True)


def compaction_window(run: Run) -> None:
    """One compaction forced with updates running (``bench.graph.updates``)."""
    a, forced = run.args, {}
    seconds = updates.compaction_window_s(run)

    def event(win0: float) -> None:
        updates.compact_at(run, win0 + updates.COMPACTION_LEAD_S, forced)

    row, _ = window(run, "compaction", seconds, a.compaction_rate, event)
    row["compaction"] = forced
    print(report.row_line(row), flush=True)


def kill_window(run: Run) -> None:
    """kill -9 of an engine core --event-at-s into the window (no standby: a fresh start)."""
    a, kill = run.args, {}

    def event(win0: float) -> None:
        time.sleep(max(0.0, win0 + a.event_at_s - time.time()))
        try:
            kill.update(faults.kill_role(run.daemon, "engine", a.restart_timeout_s))
        except Exception as exc:  # noqa: BLE001 - named in the result, the run goes on
            kill["error"] = f"{type(exc).__name__}: {exc}"

    row, recs = window(run, "engine kill -9", a.kill_seconds, event=event)
    t_kill = kill.pop("killed_wall_s", None)
    if t_kill is not None:
        ok = recs.status == OK
        kill["at_s"] = t_kill - recs.win0
        kill["answers_again_after_s"] = report.answers_again_after_s(recs.sched, recs.done, ok,
                                                                     t_kill)
        kill["longest_gap_s"] = report.longest_gap_s(recs.done, ok, recs.win0, recs.win1)
    row["kill"] = kill
    print(report.row_line(row), flush=True)


def phases(run: Run) -> None:
    """Capacity, the steady window, then each event's window in --events order."""
    a = run.args
    if not run.afford("capacity", len(a.capacity_callers) * run.step_cost_s(a.capacity_seconds)):
        return
    updates.measure_capacity(run)
    if not run.afford("steady", run.step_cost_s(a.seconds)):
        return
    steady_window(run)
    costs = {"updates": 0.0, "model": a.model_seconds, "kill": a.kill_seconds,
             "compaction": a.compaction_seconds}
    steps = {"updates": update_windows, "model": model_window, "compaction": compaction_window,
             "kill": kill_window}
    for name in a.events:
        if name == "updates" or run.afford(name, run.step_cost_s(costs[name])):
            steps[name](run)


def prepare(cfg: Any, folder: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The graph saved as an .npz; the repository with version 1 only (version 2's weights kept
    for the load); the daemon's config serving it, standby processes off."""
    npz, facts = saved_graph_facts(cfg, folder)
    in_channels = load_width(npz)
    repo, model_cfg = reload.make_repository(cfg, folder, in_channels)
    fields: dict[str, object] = {"graph.update_log_dir": str(folder / "graph-state"),
                                 "models.repository": str(repo), "models.default": reload.MODEL,
                                 "server.standby_processes": 0}
    if args.admin_token:
        fields["server.admin_token"] = args.admin_token
    facts.update(model=reload.MODEL, repo=repo, model_config=model_cfg,
                 new_state=reload.random_state(cfg, in_channels, reload.NEW))
    return serve_config(cfg, npz, folder, fields=fields), facts


def load_width(npz: Path) -> int:
    """The feature width of the saved graph (the model's in_channels)."""
    import numpy as np

    with np.load(npz, mmap_mode="r") as z:
        return int(z["x"].shape[1])


def meta(args: argparse.Namespace, cfg: Any, facts: dict) -> dict[str, Any]:
    return results.run_meta(
        args, cfg, graph=facts["graph"], protocol="http-npy",
        workload=f"b ({args.ids_per_request} ids uniform over every node)",
        load_fraction=args.load_fraction, load_req_per_s=args.load_req_per_s or None,
        seconds=args.seconds, warmup_s=args.warmup,
        events=args.events, edges_per_call=args.edges_per_call,
        remove_fraction=args.remove_fraction, degree_bias=args.degree_bias,
        update_procs=args.update_procs, update_inflight=args.update_inflight,
        load_procs=args.procs, fsync=cfg.graph.fsync,
        overlay_capacity_edges=cfg.graph.overlay_capacity_edges,
        exact_materialize=cfg.exact.materialize, repository_config=facts["model_config"],
        standby_processes=0)


def finish(run: Run | None, info: dict, out: Path, skipped: list[str], t0: float) -> None:
    """The JSON, then the targets and the table printed last."""
    rows = run.rows if run else []
    capacity = {k: v for k, v in (run.capacity if run else {}).items() if k != "points"}
    result = {"meta": info, "capacity": capacity,
              "capacity_points": (run.capacity.get("points") if run else None) or [],
              "rows": rows, "targets": report.targets(rows),
              "skipped": skipped + (run.skipped if run else []),
              "wall_s": time.perf_counter() - t0}
    results.write_result(out, result)
    results.print_head(result, info, "(b) http-npy")
    if run is not None and capacity:
        share = run.rate() / capacity["req_per_s"]
        print(f"{capacity_text(capacity)}; windows at {share:.2g} of it ({run.rate():,.0f} req/s)")
    print(report.targets_line(result["targets"]))
    print(report.TABLE_HEADER)
    for r in rows:
        print(report.row_line(r))


def main(argv: list[str] | None = None) -> int:
    from loadtest.updater import UpdaterPool

    args = parse_args(argv)
    results.exit_on_sigterm()
    cfg = results.load_config(args.config, args.sets)
    out = results.result_path("change", args, "smoke" if args.smoke else None)
    run, info, s = None, {}, Session("qs-change-")
    try:
        with s:
            conf, facts = prepare(cfg, s.folder, args)
            info = meta(args, cfg, facts)
            daemon = s.serve(conf, smoke=args.smoke, ready_timeout_s=args.start_timeout_s,
                             grace_s=SERVER_GRACE_S, args=("--log-level", "warning"))
            gen = s.own(Generator(args.procs, args.warmup, args.seconds))
            rec = s.own(RecorderPool(args.procs))
            upd = s.own(UpdaterPool(args.update_procs))
            print(f"daemon ready in {daemon.wait_ready():.1f} s; {args.procs} load and "
                  f"{args.update_procs} updater process(es)", flush=True)
            run = Run(args, daemon, gen, rec, upd, facts, s.t0)
            phases(run)
    finally:
        finish(run, info, out, s.skipped, s.t0)
    return s.code


if __name__ == "__main__":
    sys.exit(main())
