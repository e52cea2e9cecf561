#!/usr/bin/env python
"""Serving under graph updates (docs/architecture.md, "The living graph"): embed latency, update
throughput and staleness.

One daemon (``server.py``, the graph of --config saved once as an .npz), workload (b) (48 ids
uniform over every node) from the load generator's processes (``loadtest/``, HTTP npy as the
front-door figures), and updater processes posting edge batches to ``POST /v1/graph/edges``
(``loadtest/updater.py``):

1. capacity: closed-loop callers doubling until p99 passes --stop-p99-ms; capacity = the most
   req/s at p99 <= --capacity-bound-ms (0: the most req/s of any point);
2. baseline: open loop (Poisson) at --load-fraction of it, no updates;
3. the same load with the updaters at each --update-rates (edge updates/s, calls of
   --edges-per-call pairs, a --remove-fraction of them removing edges added earlier): acknowledged
   edge updates/s, update call p50 / p99, embed p50 / p99 / p99.9 and throughput, staleness
   (the daemon's histogram, and ``GET /v1/graph`` polled), 5xx counts, compactions;
4. one compaction forced (``POST /v1/graph/compact``) during the same load: its duration, and
   embed p99 while it ran (the daemon's request histogram between its start and end) and over
   the step's window.

Budgeted (--budget-s): a step that would start past it is skipped and named. The JSON goes to
--out, else --out-dir (default $OUT, else bench/results/) as updates_<machine>_<date>[_<variant>]
.json; a table is printed last.

    python -m bench.graph.updates                    # Reddit-scale, configs/bench_reddit.yaml
    python -m bench.graph.updates --smoke            # Cora on a CPU box, under a minute
    python -m bench.gpu updates                      # the GPU runner's suite
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loadtest import watch
from loadtest.gen import Generator, add_capacity_options
from loadtest.harness import Session, saved_graph_facts, serve_config
from loadtest.results import (
    Budget,
    add_run_options,
    doc_parser,
    exit_on_sigterm,
    load_config,
    print_head,
    result_path,
    run_meta,
    smoke_settings,
    write_result,
)
from loadtest.stats import best_under, capacity_text, fmt
from loadtest.updater import UpdaterPool, add_updater_options

SERVER_GRACE_S = 8.0
COMPACTION_LEAD_S = 0.5  # into the window before the compaction is asked for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.graph.updates", __doc__)
    add_run_options(ap, budget_s=500.0, start_timeout_s=600.0)
    ap.add_argument("--protocol", default="http-npy", choices=["http-npy", "http-json",
                                                                "kserve-binary"])
    add_capacity_options(ap, [16, 32, 64, 128, 256, 512])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window of each step")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--update-rates", type=float, nargs="+",
                    default=[25_000, 50_000, 100_000, 200_000], help="edge updates/s per step")
    add_updater_options(ap)
    ap.add_argument("--no-compaction", action="store_true")
    ap.add_argument("--compaction-seconds", type=float, default=20.0)
    ap.add_argument("--compaction-timeout-s", type=float, default=180.0,
                    help="longest wait for the forced compaction to end")
    ap.add_argument("--compaction-rate", type=float,
                    help="edge updates/s during the compaction step (default the first rate)")
    ap.add_argument("--admin-token", help="server.admin_token, sent as the bearer token")
    ap.add_argument("--poll-interval-s", type=float, default=0.1)
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args)
    return args


def smoke(args: argparse.Namespace) -> None:
    """Cora, small rates and short windows; the pure-torch sampler (no C++ build in the time)."""
    smoke_settings(args, budget_s=75.0)
    args.capacity_callers, args.capacity_seconds = [1, 2, 4], 0.8
    args.seconds, args.warmup, args.compaction_seconds = 1.5, 0.3, 3.0
    args.update_rates, args.edges_per_call, args.update_procs = [500.0, 2000.0], 100, 1
    args.compaction_timeout_s = min(args.compaction_timeout_s, 30.0)
    args.load_fraction = min(args.load_fraction, 0.5)  # a 2-core box runs daemon and load alike


class Run(Budget):
    """The run's state: budget, daemon URL, load and updater processes, results."""

    def __init__(self, args: argparse.Namespace, url: str, gen: Generator, updaters: UpdaterPool,
                 facts: dict, t0: float) -> None:
        super().__init__(args.budget_s, t0)  # from the bench's start (graph build, daemon start)
        self.args, self.url, self.gen, self.updaters, self.facts = args, url, gen, updaters, facts
        self.headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
        self.spec = {"workload": "b", "hot": None, "num_nodes": facts["num_nodes"], "seed": 0,
                     "ids_per_request": args.ids_per_request}
        self.target = {"protocol": args.protocol, "url": url, "model": facts["model"],
                       "timeout_s": args.timeout_s, "http_client": "aiohttp"}
        self.capacity: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.compaction: dict[str, Any] | None = None

    def step_cost_s(self, seconds: float) -> float:
        return seconds + self.args.warmup + 3.0

    def update_cmd(self, rate: float, t_start: float, seconds: float) -> dict[str, Any]:
        a = self.args
        return {"url": self.url, "headers": self.headers, "rate": rate,
                "edges_per_call": a.edges_per_call, "remove_fraction": a.remove_fraction,
                "degree_bias": a.degree_bias, "num_nodes": self.facts["num_nodes"],
                "indptr": self.facts["indptr"], "seed": len(self.rows) + 1, "t_start": t_start,
                "warm_s": a.warmup, "seconds": seconds, "inflight": a.update_inflight,
                "timeout_s": a.timeout_s}


def measure_capacity(run: Any, workload: str = "(b)") -> None:
    """Closed-loop callers doubling; capacity = most req/s under the bound (or of any point).
    ``run``: this bench's ``Run``, or another's with the same fields (``bench.models.reload``)."""
    a, gen = run.args, run.gen
    gen.warm_s, gen.seconds = a.warmup, a.capacity_seconds
    protocol = getattr(a, "protocol", "http-npy")
    print(f"\n== capacity, workload {workload}, {protocol}, closed loop ==", flush=True)
    res = gen.sweep(run.target, run.spec, "closed", a.capacity_callers, a.stop_p99_ms,
                    [a.capacity_bound_ms or a.stop_p99_ms], run.url)
    points = res["points"]
    best = best_under(points, a.capacity_bound_ms) if a.capacity_bound_ms else None
    under = best is not None
    best = best or max(points, key=lambda p: p["req_per_s"])
    run.capacity = {"req_per_s": best["req_per_s"], "seed_nodes_per_s": best["seed_nodes_per_s"],
                    "callers": best["level"], "p99_ms": best["p99_ms"],
                    "bound_ms": a.capacity_bound_ms if under else None, "points": points}
    print(f"capacity {best['req_per_s']:,.0f} req/s ({best['seed_nodes_per_s']:,.0f} seeds/s, "
          f"{best['level']:g} callers, p99 {fmt(best['p99_ms'])} ms"
          f"{'' if under else ', no point under the bound: the most of any point'})", flush=True)


def measured_step(run: Run, name: str, rate: float, seconds: float,
                  compaction: bool = False) -> dict[str, Any]:
    """One open-loop point at the step load, updaters at ``rate`` (0: none), the daemon watched;
    with ``compaction``, one compaction forced early in the window."""
    gen, a = run.gen, run.args
    gen.warm_s, gen.seconds = a.warmup, seconds
    w = watch.Watch(run.url, run.headers, a.poll_interval_s)
    forced: dict[str, Any] = {}
    threads: list[threading.Thread] = []

    def on_start(t_start: float) -> None:
        win0 = t_start + a.warmup
        if rate > 0:
            run.updaters.start(run.update_cmd(rate, t_start, seconds))
        w.start(win0, win0 + seconds)
        if compaction:
            threads.append(threading.Thread(target=compact_at, daemon=True,
                                            args=(run, win0 + COMPACTION_LEAD_S, forced)))
            threads[0].start()

    embed_rps = a.load_fraction * run.capacity["req_per_s"]
    print(f"\n== {name}: embed {embed_rps:,.0f} req/s open loop, edge updates "
          f"{rate:,.0f}/s ==", flush=True)
    point = gen.point(run.target, run.spec, "open", embed_rps, run.url, on_start)
    upd = run.updaters.collect() if rate > 0 else None
    for t in threads:
        t.join(timeout=a.compaction_timeout_s + 30)
    row = step_row(name, point, upd, w.result())
    if compaction:
        row["compaction"] = forced
    print(row_line(row), flush=True)
    return row


def compact_at(run: Run, at: float, out: dict[str, Any]) -> None:
    """At ``at`` (wall clock): /metrics, force a compaction and wait for it, /metrics again."""
    from loadtest import promdiff

    time.sleep(max(0.0, at - time.time()))
    before = promdiff.scrape(run.url)
    out.update(watch.force_compaction(run.url, run.headers,
                                      timeout_s=run.args.compaction_timeout_s))
    after = promdiff.scrape(run.url)
    if before and after and out.get("duration_s") is not None:
        out["embed_server_during"] = watch.hist_window(
            before, after, watch.REQUEST_DURATION, {"endpoint": watch.EMBED_ENDPOINT,
                                                    "status": "200"})
        out["embed_statuses_during"] = watch.embed_statuses(before, after)


def fivexx(statuses: dict[str, int]) -> int:
    return sum(v for k, v in statuses.items() if k.startswith("5"))


def step_row(name: str, point: dict, upd: dict | None, seen: dict) -> dict[str, Any]:
    """The step's figures, flat for the table; the full updater and watch reports kept beside."""
    m = seen.get("metrics") or {}
    stale = m.get("staleness") or {}
    upd_errors = {k: v for k, v in (upd or {}).get("status", {}).items() if k != "200"}
    return {
        "step": name, "target_edges_per_s": (upd or {}).get("target_edges_per_s", 0.0),
        "acked_edges_per_s": (upd or {}).get("acked_edges_per_s", 0.0),
        "update_p50_ms": (upd or {}).get("call_p50_ms"),
        "update_p99_ms": (upd or {}).get("call_p99_ms"),
        "update_errors": upd_errors, "update_5xx": fivexx(upd_errors),
        "update_skipped": (upd or {}).get("skipped", 0),
        "embed_req_per_s": point["req_per_s"], "seed_nodes_per_s": point["seed_nodes_per_s"],
        "embed_p50_ms": point["p50_ms"], "embed_p99_ms": point["p99_ms"],
        "embed_p999_ms": point["p999_ms"], "embed_errors": point["errors"],
        "embed_5xx": fivexx(point["errors"]),
        "staleness_p50_ms": stale.get("p50_ms"), "staleness_p99_ms": stale.get("p99_ms"),
        "staleness_count": stale.get("count", 0),
        "staleness_polled_ms": seen["staleness_polled_ms"], "version_lag": seen["version_lag"],
        "compactions": sum(v for k, v in (m.get("counters") or {}).items()
                           if k.startswith("quiver_serve_graph_compactions_total")),
        "graph_after": seen["graph"], "load_cpu_cores": point["load_cpu_cores"],
        "send_lag_p99_ms": point["send_lag_p99_ms"], "updater": upd, "metrics": m,
        "stages": point.get("stages"),
    }


def row_line(r: dict) -> str:
    polled = r["staleness_polled_ms"]
    return (f"| {r['step']} | {r['target_edges_per_s']:,.0f} / {r['acked_edges_per_s']:,.0f} | "
            f"{fmt(r['update_p50_ms'])} / {fmt(r['update_p99_ms'])} | "
            f"{r['embed_req_per_s']:,.0f} | {r['seed_nodes_per_s']:,.0f} | "
            f"{fmt(r['embed_p50_ms'])} / {fmt(r['embed_p99_ms'])} / {fmt(r['embed_p999_ms'])} | "
            f"{fmt(r['staleness_p50_ms'])} / {fmt(r['staleness_p99_ms'])} | "
            f"{fmt(polled['p99'])} / {fmt(polled['max'])} | {r['embed_5xx']} / {r['update_5xx']} "
            f"| {r['compactions']:g} |")


TABLE_HEADER = (
    "| step | edge updates/s target / acked | update call p50 / p99 ms | embed req/s | seeds/s "
    "| embed p50 / p99 / p99.9 ms | staleness p50 / p99 ms (histogram) | staleness polled p99 / "
    "max ms | 5xx embed / update | compactions |\n|---|---|---|---|---|---|---|---|---|---|")


def phases(run: Run) -> None:
    """Capacity, the baseline, each update rate, then the forced compaction."""
    a = run.args
    if not run.afford("capacity", len(a.capacity_callers) * run.step_cost_s(a.capacity_seconds)):
        return
    measure_capacity(run)
    if run.afford("baseline", run.step_cost_s(a.seconds)):
        run.rows.append(measured_step(run, "no updates", 0.0, a.seconds))
    for rate in a.update_rates:
        if not run.afford(f"updates {rate:g}/s", run.step_cost_s(a.seconds)):
            break
        row = measured_step(run, f"updates {rate:g}/s", rate, a.seconds)
        run.rows.append(row)
        if row["updater"] and row["updater"]["calls_ok"] == 0:
            run.skipped.append(f"higher update rates: no call answered 200 at {rate:g}/s "
                               f"({row['update_errors']})")
            print(f"SKIPPED {run.skipped[-1]}", flush=True)
            break
    if a.no_compaction:
        return
    if not offers_compaction(run):
        run.compaction = {"offered": False}
        print("the daemon does not offer POST /v1/graph/compact: no compaction step", flush=True)
        return
    seconds = compaction_window_s(run)
    if run.afford("compaction", run.step_cost_s(seconds)):
        rate = a.compaction_rate if a.compaction_rate is not None else a.update_rates[0]
        row = measured_step(run, "compaction", rate, seconds, compaction=True)
        run.rows.append(row)
        run.compaction = row["compaction"]


def compaction_window_s(run: Run) -> float:
    """--compaction-seconds, or longer when a compaction the daemon ran on its own took longer:
    the load should cover the whole forced one."""
    _, info = watch.http_json(run.url + watch.GRAPH_PATH, headers=run.headers)
    last = (info or {}).get("last_compaction") or {}
    took_s = float(last.get("duration_s") or 0.0)
    return max(run.args.compaction_seconds, min(1.5 * took_s + 2.0, run.args.compaction_timeout_s))


def offers_compaction(run: Run) -> bool:
    """Whether the daemon's OpenAPI names ``POST /v1/graph/compact`` (no OpenAPI: try it)."""
    status, spec = watch.http_json(run.url + "/openapi.json")
    if status != 200 or not isinstance(spec, dict):
        return True
    return "post" in (spec.get("paths", {}).get(watch.COMPACT_PATH) or {})


def prepare(cfg: Any, folder: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The graph built once and saved as an .npz the daemon loads; the daemon's config beside it
    (its update log in ``folder``); what the load and the updaters need of the graph."""
    npz, facts = saved_graph_facts(cfg, folder)
    fields = {"graph.update_log_dir": str(folder / "graph-state")}
    if args.admin_token:
        fields["server.admin_token"] = args.admin_token
    return serve_config(cfg, npz, folder, fields=fields), facts


def meta(args: argparse.Namespace, cfg: Any, facts: dict) -> dict[str, Any]:
    return run_meta(args, cfg, graph=facts["graph"], protocol=args.protocol,
                    workload=f"b ({args.ids_per_request} ids uniform over every node)",
                    load_fraction=args.load_fraction, edges_per_call=args.edges_per_call,
                    remove_fraction=args.remove_fraction, degree_bias=args.degree_bias,
                    update_procs=args.update_procs, update_inflight=args.update_inflight,
                    load_procs=args.procs, fsync=cfg.graph.fsync)


def finish(run: Run | None, info: dict, out: Path, skipped: list[str], t0: float) -> None:
    """The JSON, then the table printed last."""
    rows = run.rows if run else []
    capacity = {k: v for k, v in (run.capacity if run else {}).items() if k != "points"}
    result = {"meta": info, "capacity": capacity,
              "capacity_points": (run.capacity.get("points") if run else None) or [],
              "rows": rows, "compaction": run.compaction if run else None,
              "skipped": skipped + (run.skipped if run else []),
              "wall_s": time.perf_counter() - t0}
    write_result(out, result)
    print_head(result, info, f"(b) {info.get('protocol')}")
    if run is not None and capacity:
        print(f"{capacity_text(capacity)}; steps at {run.args.load_fraction:g} of it")
    print(TABLE_HEADER)
    for r in rows:
        print(row_line(r))
    print(compaction_line(result["compaction"]))


def compaction_line(c: dict | None) -> str:
    if c is None:
        return "compaction: not run"
    if not c.get("offered", True):
        return "compaction: POST /v1/graph/compact not offered by the daemon"
    if c.get("duration_s") is None:
        return f"compaction: asked (status {c.get('status')}), no end seen {c.get('answer')}"
    during = c.get("embed_server_during") or {}
    return (f"compaction: {c['duration_s']:.2f} s; embed p99 while it ran (daemon histogram) "
            f"{fmt(during.get('p99_ms'))} ms over {during.get('count', 0)} requests, statuses "
            f"{c.get('embed_statuses_during')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    cfg = load_config(args.config, args.sets)
    out = result_path("updates", args, "smoke" if args.smoke else None)
    run, info, s = None, {}, Session("qs-updates-")
    try:
        with s:
            conf, facts = prepare(cfg, s.folder, args)
            info = meta(args, cfg, facts)
            daemon = s.serve(conf, smoke=args.smoke, ready_timeout_s=args.start_timeout_s,
                             grace_s=SERVER_GRACE_S, args=("--log-level", "warning"))
            gen = s.own(Generator(args.procs, args.warmup, args.seconds))
            updaters = s.own(UpdaterPool(args.update_procs))
            print(f"daemon ready in {daemon.wait_ready():.1f} s; {args.procs} load and "
                  f"{args.update_procs} updater process(es)", flush=True)
            run = Run(args, daemon.url, gen, updaters, facts, s.t0)
            phases(run)
    finally:
        finish(run, info, out, s.skipped, s.t0)
    return s.code


if __name__ == "__main__":
    sys.exit(main())
