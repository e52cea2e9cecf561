#!/usr/bin/env python
"""The headline benchmark (issue 9): quiver-serve against a PyG-style server, one run, one table.

1. Builds the graph of --config once (Reddit-scale synthetic by default) and saves it as an .npz in
   a temporary folder; every server of the run loads that file (no graph generation per start).
2. For each sampling route (auto, cpu, gpu): starts ``server.py`` (HTTP + KServe gRPC) and sweeps
   closed-loop load (callers doubling until p99 > --stop-p99-ms) over HTTP JSON, HTTP npy, KServe
   binary and gRPC, workload (a); on the first route also single-id (c) HTTP p50 with one caller.
3. The queue API: ``Pipeline`` in this process (first route only, --queue-routes for more), load
   processes connected with ``connect(endpoints)``.
4. The baseline (bench/frontdoor/baseline_server.py: FastAPI, one process, PyG's sampler, CPU gather, model
   on the GPU): HTTP JSON and npy, workload (a), and single-id (c).
5. One table: max seed nodes/s at p99 <= 10 ms and <= 30 ms for every path and the baseline, and
   the ratio to the baseline's best at the same bound; PNGs: throughput vs p99, latency CDFs.

Everything is timed against --budget-s: a phase that would start past it is skipped and named.
The same load processes (loadtest/, spawned once) drive every server; every server is started by
the daemon harness (loadtest/harness.py). In --out (default $OUT, else bench/results/):
headline_<machine>_<date>[_<variant>].json and its two PNGs (same name, _throughput_vs_p99.png,
_latency_cdf.png).

    python -m bench.frontdoor.headline [--config configs/bench_reddit.yaml] [--out DIR]
    python -m bench.frontdoor.headline --smoke     # Cora on a CPU box, about 2 minutes
    python -m bench.frontdoor.headline --single-only --routes auto --seconds 5
                                                   # single-id HTTP only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import plots
from loadtest.gen import Generator
from loadtest.harness import Daemon, baseline_daemon, free_port, save_graph, serve_config
from loadtest.results import (
    Budget,
    add_run_options,
    doc_parser,
    exit_on_sigterm,
    load_config,
    result_name,
    results_dir,
    run_meta,
    smoke_settings,
    write_result,
)
from loadtest.stats import best_under, fmt, point_row
from loadtest.workloads import hot_set

HTTP_PATHS = ["http-json", "http-npy", "kserve-binary", "grpc"]
BOUNDS_MS = (10.0, 30.0)
SERVER_GRACE_S = 8.0  # SIGTERM to SIGKILL of a server's process group


def route_config(cfg: Any, npz: Path, route: str, folder: Path, grpc_port: int | None) -> Path:
    """The run's config for one route: the saved .npz as graph, everything else from --config."""
    return serve_config(cfg, npz, folder, f"serve_{route}",
                        {"sampling.route": route, "server.grpc_port": grpc_port})


def route_daemon(cfg: Any, npz: Path, route: str, folder: Path, grpc_port: int | None) -> Daemon:
    """``server.py`` on one sampling route (not started yet: ``Run.serving`` waits for it)."""
    return Daemon(route_config(cfg, npz, route, folder, grpc_port),
                  log_path=folder / f"server_{route}.log", args=["--log-level", "warning"],
                  name=f"quiver-serve ({route})", grace_s=SERVER_GRACE_S)


class Run(Budget):
    """The run's state: budget, load processes, workload specs, results by series."""

    def __init__(self, args: argparse.Namespace, gen: Generator, spec_a: dict, spec_c: dict) -> None:
        super().__init__(args.budget_s)
        self.args, self.gen, self.spec_a, self.spec_c = args, gen, spec_a, spec_c
        self.series: dict[str, dict] = {}
        self.single: dict[str, dict] = {}
        self.starts: dict[str, float] = {}
        self.levels = [c for c in args.clients]
        self.baseline_info: dict | None = None

    def start_cost_s(self) -> float:
        """Expected server start: the last quiver-serve start (the first one also builds the C++
        sampler), else --start-cost-s."""
        quiver = [v for k, v in self.starts.items() if k.startswith("quiver-serve")]
        return quiver[-1] if quiver else self.args.start_cost_s

    def sweep_cost_s(self) -> float:
        return 3 * (self.args.seconds + self.args.warmup + 0.8)

    def sweep(self, name: str, target: dict, metrics: str | None) -> None:
        if not self.afford(f"sweep {name}", self.sweep_cost_s()):
            return
        print(f"\n== {name} ==", flush=True)
        res = self.gen.sweep(target, self.spec_a, "closed", self.levels, self.args.stop_p99_ms,
                             list(BOUNDS_MS), metrics, deadline=self.t0 + self.args.budget_s)
        self.series[name] = res

    def single_id(self, name: str, target: dict) -> None:
        if not self.afford(f"single-id {name}", self.args.seconds + self.args.warmup + 1):
            return
        p = self.gen.point(target, self.spec_c, "closed", 1)
        print(f"single id, 1 caller, {name}: " + point_row(p), flush=True)
        self.single[name] = p


def target_of(protocol: str, url: str, grpc_port: int | None, model: str, args: argparse.Namespace,
              endpoints: Any = None) -> dict:
    return {"protocol": protocol, "url": url, "grpc_target": f"127.0.0.1:{grpc_port}",
            "model": model, "timeout_s": args.timeout_s, "http_client": "aiohttp",
            "endpoints": endpoints}


def quiver_route(run: Run, cfg: Any, npz: Path, route: str, folder: Path, first: bool) -> None:
    """server.py with one sampling route: every HTTP/gRPC path; single-id on the first route."""
    if not run.afford(f"route {route}", run.start_cost_s() + run.sweep_cost_s()):
        return
    grpc_port = free_port()
    srv = route_daemon(cfg, npz, route, folder, grpc_port)
    url = srv.url
    with run.serving(srv, f"route {route}", run.args.start_timeout_s) as ready_s:
        if ready_s is None:
            return
        run.starts[srv.name] = ready_s
        for protocol in run.args.paths:
            if protocol == "queue":
                continue
            t = target_of(protocol, url, grpc_port, cfg.model.name, run.args)
            run.sweep(f"{route}/{protocol}", t, url)
        if first:
            for protocol in ("http-json", "http-npy"):
                run.single_id(f"{route}/{protocol}", target_of(protocol, url, grpc_port,
                                                               cfg.model.name, run.args))


SINGLE_PATHS = ("http-json", "http-npy", "kserve-binary")


def single_only(run: Run, cfg: Any, npz: Path, folder: Path) -> None:
    """--single-only: single-id (c), one caller, on the first route: the front door's
    per-request cost."""
    route = run.args.routes[0]
    if not run.afford("single-id", run.start_cost_s() + 10):
        return
    srv = route_daemon(cfg, npz, route, folder, None)
    url = srv.url
    with run.serving(srv, f"single-id {route}", run.args.start_timeout_s) as ready_s:
        if ready_s is None:
            return
        run.starts[srv.name] = ready_s
        for protocol in SINGLE_PATHS:
            run.single_id(f"{route}/{protocol}", target_of(protocol, url, None, cfg.model.name,
                                                           run.args))


def queue_route(run: Run, cfg: Any, graph: Any, route: str) -> None:
    """The queue API: Pipeline in this process, load processes connect(endpoints)."""
    from quiver_serve.engine.client.pipeline import Pipeline

    if not run.afford(f"queue API ({route})", run.start_cost_s() + run.sweep_cost_s()):
        return
    c = cfg.model_copy(deep=True)
    c.sampling.route = route
    t0 = time.perf_counter()
    p = Pipeline(c, graph=graph).start()
    try:
        run.starts[f"queue API {route}"] = time.perf_counter() - t0
        print(f"\nPipeline route={route} ready in {run.starts[f'queue API {route}']:.1f} s", flush=True)
        run.sweep(f"{route}/queue", target_of("queue", "", None, c.model.name, run.args,
                                              p.endpoints()), "local")
    finally:
        p.stop()


def baseline(run: Run, cfg: Any, npz: Path, folder: Path) -> None:
    if not run.afford("baseline", run.start_cost_s() / 2 + run.sweep_cost_s()):
        return
    srv = baseline_daemon(route_config(cfg, npz, "auto", folder, None), folder,
                          grace_s=SERVER_GRACE_S)
    url = srv.url
    with run.serving(srv, "baseline", run.args.start_timeout_s) as ready_s:
        if ready_s is None:
            return
        run.starts["baseline"] = ready_s
        run.baseline_info = srv.get_json("/v1/baseline")
        print(f"baseline: {run.baseline_info}", flush=True)
        for protocol in ("http-json", "http-npy"):
            run.sweep(f"baseline/{protocol}", target_of(protocol, url, None, cfg.model.name,
                                                        run.args), None)
        run.single_id("baseline/http-json", target_of("http-json", url, None, cfg.model.name,
                                                      run.args))


def table(run: Run) -> tuple[list[dict], str]:
    """Rows (one per series) and the markdown table: max seed nodes/s at each bound, ratio to the
    baseline's best at that bound."""
    base = {b: max((best_under(s["points"], b) or {}).get("seed_nodes_per_s", 0.0)
                   for n, s in run.series.items() if n.startswith("baseline/"))
            if any(n.startswith("baseline/") for n in run.series) else 0.0 for b in BOUNDS_MS}
    rows, lines = [], []
    head = " | ".join(f"seed nodes/s at p99 <= {b:g} ms (callers, p99) | x baseline" for b in BOUNDS_MS)
    lines += [f"| path | {head} | load CPU (max process, cores) |",
              "|---|" + "---|---|" * len(BOUNDS_MS) + "---|"]
    for name, s in run.series.items():
        row: dict[str, Any] = {"series": name}
        cells = []
        for b in BOUNDS_MS:
            best = best_under(s["points"], b)
            v = best["seed_nodes_per_s"] if best else None
            ratio = v / base[b] if v and base[b] else None
            row[f"p99<={b:g}ms"] = v
            row[f"x_baseline_p99<={b:g}ms"] = ratio
            cells.append("none" if best is None else
                         f"{v:,.0f} ({best['level']:g}, {best['p99_ms']:.1f} ms)")
            cells.append(fmt(ratio, ".1f"))
        row["load_cpu_max"] = max((max(p["load_cpu_cores"], default=0.0) for p in s["points"]),
                                  default=0.0)
        cells.append(f"{row['load_cpu_max']:.2f}")
        rows.append(row)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, p in run.single.items():
        lines.append(f"\nsingle id, 1 caller, {name}: p50 {fmt(p['p50_ms'])} ms, "
                     f"p99 {fmt(p['p99_ms'])} ms")
    return rows, "\n".join(lines + stage_lines(run))


def stage_lines(run: Run) -> list[str]:
    """Where the time goes at each path's best point (p99 <= the largest bound): the server's
    per-batch stage means from /metrics, next to the client's p50."""
    names = ("queue", "sample", "gather", "compute", "request")
    out = [f"\nserver stages at each path's best point at p99 <= {BOUNDS_MS[-1]:g} ms (mean ms per "
           "batch; request: per HTTP request):",
           "| path | callers | client p50 | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
    for name, s in run.series.items():
        p = best_under(s["points"], BOUNDS_MS[-1])
        if p is None or not p.get("stages"):
            continue
        cells = [fmt((p["stages"].get(k) or {}).get("mean_ms")) for k in names]
        out.append(f"| {name} | {p['level']:g} | {fmt(p['p50_ms'])} | " + " | ".join(cells) + " |")
    return out


def write_plots(run: Run, stem: Path, title: str) -> None:
    """``<stem>_throughput_vs_p99.png`` and ``<stem>_latency_cdf.png``."""
    plots.throughput_vs_p99({n: s["points"] for n, s in run.series.items()},
                            Path(f"{stem}_throughput_vs_p99.png"), title, BOUNDS_MS)
    cdfs = {}
    for n, s in run.series.items():
        p = best_under(s["points"], BOUNDS_MS[-1]) or (s["points"][0] if s["points"] else None)
        if p is not None:
            cdfs[f"{n} @{p['level']:g}"] = p["latencies_ms"]
    plots.latency_cdf(cdfs, Path(f"{stem}_latency_cdf.png"),
                      title + " (best point at p99 <= 30 ms)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser(None, __doc__)
    add_run_options(ap, budget_s=500.0, start_timeout_s=240.0, out_file=False)
    ap.add_argument("--routes", nargs="+", default=["auto", "gpu", "cpu"], choices=["auto", "cpu", "gpu"],
                    help="sampling.route of each quiver-serve start, in this order")
    ap.add_argument("--queue-routes", nargs="+", default=None, help="routes of the queue API "
                    "path (default: the first route)")
    ap.add_argument("--paths", nargs="+", default=HTTP_PATHS + ["queue"],
                    choices=HTTP_PATHS + ["queue", "kserve-json"])
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--single-only", action="store_true",
                    help="only single-id (c) with one caller over HTTP JSON, npy and KServe "
                    "binary on the first route (~1-2 minutes)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256],
                    help="closed-loop callers per point, rising until p99 > --stop-p99-ms")
    ap.add_argument("--stop-p99-ms", type=float, default=30.0)
    ap.add_argument("--seconds", type=float, default=1.5, help="measured window per point")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--start-cost-s", type=float, default=60.0, help="expected server start-up")
    ap.add_argument("--out", default=str(results_dir()),
                    help="folder of the JSON and PNGs (default $OUT, else bench/results/)")
    args = ap.parse_args(argv)
    if args.smoke:
        procs, sets = args.procs, list(args.sets)
        smoke_settings(args, budget_s=240.0, start_timeout_s=args.start_timeout_s, procs=procs)
        args.sets = sets  # the daemon's own CPU defaults: the routes are what it measures
        args.clients, args.seconds, args.warmup, args.start_cost_s = [1, 2, 4, 8], 1.0, 0.3, 30.0
    return args


def phases(run: Run, cfg: Any, graph: Any, npz: Path, folder: Path) -> None:
    """First route, baseline, queue API, then the other routes: the ratio exists even when the
    budget cuts the run short."""
    routes = run.args.routes
    if run.args.single_only:
        single_only(run, cfg, npz, folder)
        return
    quiver_route(run, cfg, npz, routes[0], folder, first=True)
    if not run.args.no_baseline:
        baseline(run, cfg, npz, folder)
    if "queue" in run.args.paths:
        for route in run.args.queue_routes or routes[:1]:
            queue_route(run, cfg, graph, route)
    for route in routes[1:]:
        quiver_route(run, cfg, npz, route, folder, first=False)


def finish(run: Run, info: dict, out: Path) -> None:
    """The JSON (``out``), the two plots beside it, and the table printed last."""
    rows, text = table(run)
    result = {"meta": info, "baseline": run.baseline_info, "starts_s": run.starts, "rows": rows,
              "series": run.series, "single_id": run.single, "skipped": run.skipped,
              "wall_s": time.perf_counter() - run.t0}
    write_result(out, result)
    title = f"{info['graph'].split(':')[0]}, {info['device']}, workload (a), closed loop"
    stem = out.with_suffix("")
    write_plots(run, stem, title)
    print(f"wrote {stem.name}_throughput_vs_p99.png, {stem.name}_latency_cdf.png")
    if run.skipped:
        print("skipped: " + "; ".join(run.skipped))
    print(f"baseline sampler: {(run.baseline_info or {}).get('sampler')}; wall "
          f"{result['wall_s']:.0f} s\n\n{text}")


def main(argv: list[str] | None = None) -> int:
    import shutil

    import torch

    args = parse_args(argv)
    exit_on_sigterm()
    cfg = load_config(args.config, args.sets)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    variant = args.variant or ("single-id" if args.single_only else "smoke" if args.smoke else None)
    out = out_dir / result_name("headline", args.machine, variant)
    if "gpu" in args.routes and not torch.cuda.is_available():
        args.routes = [r for r in args.routes if r != "gpu"]
        print("no CUDA device: route gpu left out", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="qs-headline-"))
    gen = None
    try:
        graph, npz = save_graph(cfg, folder)
        graph.share_memory_()
        hot = hot_set(graph.degree().numpy())
        spec_a = {"workload": "a", "hot": hot, "num_nodes": graph.num_nodes, "seed": 0}
        spec_c = {"workload": "c", "hot": None, "num_nodes": graph.num_nodes, "seed": 0}
        gen = Generator(args.procs, args.warmup, args.seconds)
        run = Run(args, gen, spec_a, spec_c)
        info = run_meta(args, cfg, graph=graph.describe(),
                        workload="a (48 ids from the 1,500-node hot set)")
        print(f"{info['device']}, {info['cpus']} CPUs, torch {info['torch']}; {args.procs} load "
              f"process(es); budget {args.budget_s:.0f} s", flush=True)
        code = 0
        try:
            phases(run, cfg, graph, npz, folder)
        except SystemExit as exc:  # SIGTERM: keep what was measured
            run.skipped.append(f"cut short (exit {exc.code})")
            code = 1
        finish(run, info, out)
        return code
    finally:
        if gen is not None:
            gen.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
