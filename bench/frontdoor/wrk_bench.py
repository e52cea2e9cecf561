#!/usr/bin/env python
"""The front door measured with compiled load clients (issue 27): wrk for HTTP, the project's own
generator for gRPC and the queue API, with the CPU of every daemon process.

1. Builds the graph of --config once, saves it as an .npz (loadtest/harness.py) and starts
   ``server.py`` on it once, with a gRPC port and ``server.http_workers`` as configured (``--set
   server.http_workers=N`` or ``QUIVER_SERVE__SERVER__HTTP_WORKERS``).
2. For each workload (a: 48 ids from the 1,500-node hot set, b: 48 uniform) and path, closed-loop
   load at rising connections (--connections), each point --seconds after a --warmup-s run at the
   same connections; a sweep stops once a point's p99 passes --stop-p99-ms (or > 1% fail):
   HTTP JSON, HTTP npy and KServe v2 binary through wrk (bodies from Python in a generated Lua
   script, loadtest/wrk_lua.py); gRPC ``ModelInfer`` and ``ModelStreamInfer`` through
   ``loadtest.gen``'s lean HTTP/2 client (``grpc-h2``, ``grpc-stream-h2``: the same distinct
   bodies; unary one connection per caller) and HTTP npy through ``loadtest.gen`` (side by
   side with wrk's). ``--paths grpc-aio grpc-stream-aio`` add the same with grpc.aio's client;
   ``--paths grpc-one-body`` adds h2load's gRPC unary: it posts one body file, every request the
   same ids, which the engine core merges (checked once with a gRPC client, since h2load does not
   read trailers): the endpoint's ceiling, not a workload's figure.
3. Single id (workload c): HTTP JSON and npy with one connection (p50 / p99 / p99.9, over
   --single-seconds), then a sweep for the most requests/s at p99 <= --bound-ms (default levels:
   --connections, then twice and four times the last: a request of one id keeps the engine core
   busy only with many more in flight).
4. The queue API (the daemon in this process, load processes ``connect()``) as the reference,
   per workload, after the daemon is stopped (its time is reserved from the start).
5. During every point: CPU time of each daemon process (role from /v1/workers: main, frontend i,
   engine core i, sampler i, standby) and of the load client: CPU-ms per request by role.

Printed last: the best point of every path and workload at p99 <= --bound-ms (seeds/s, req/s,
connections, p50 / p99 / p99.9, p99.9 / p99, errors, ratio to the queue API's seeds/s), the
single-id latency rows, and the CPU per request by role at those points. Phases that would start
past --budget-s are skipped and named. JSON: ``wrk_bench_<machine>_<date>[_<variant>].json`` in
$OUT (else bench/results/), or --out FILE.

    python -m bench.frontdoor.wrk_bench                  # GPU box: configs/bench_reddit.yaml
    python -m bench.frontdoor.wrk_bench --smoke          # Cora on a CPU box, about 2 minutes
    python -m bench.frontdoor.wrk_bench --set server.http_workers=8 --workloads a
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import clients as lc
from loadtest import report
from loadtest.cpu import TreeCpu, role_class
from loadtest.harness import Daemon, free_port, save_graph, serve_config
from loadtest.meter import OPT_IN_PATHS, PATHS, Meter, Target, Workloads, routes
from loadtest.results import (
    Budget,
    add_run_options,
    doc_parser,
    exit_on_sigterm,
    load_config,
    result_path,
    smoke_settings,
)
from loadtest.stats import served
from quiver_serve.engine.procs.standby import SETTLE_S as STANDBY_SETTLE_S
from quiver_serve.engine.procs.standby import SPAWN_GAP_S

DAEMON_PATHS = ["http-npy", "kserve-binary", "grpc", "http-json", "gen-npy", "grpc-stream",
                "grpc-aio", "grpc-stream-aio", "grpc-one-body"]
SINGLE_PATHS = ["http-json", "http-npy"]
SERVER_GRACE_S = 8.0
DEFAULTS = {"workloads": ["a", "b"], "connections": [16, 32, 64, 128, 256], "seconds": 3,
            "single_seconds": 5}
SMOKE = {"workloads": ["a"], "connections": [1, 4, 16], "connections_c": [4, 16], "seconds": 1,
         "single_seconds": 2}
SETTLE_S = 45.0  # longest wait for the daemon's spare processes to go quiet after it is ready
SETTLED_CORES = 0.05  # spare processes below this are quiet
#: quiet windows (1 s) in a row: longer than a pool waits before it spawns its spare
#: (``standby.SETTLE_S`` after its own children are ready, then ``SPAWN_GAP_S`` apart), so a
#: second pool's spare is not missed after the first one went quiet
QUIET_WINDOWS = math.ceil(STANDBY_SETTLE_S + SPAWN_GAP_S) + 1
DOES_NOT_RUN = "unknown (does not run"


class Run(Budget):
    """The run's state: budget, tools, load processes, results."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        super().__init__(args.budget_s)
        self.args, self.folder = args, folder
        self.tools: dict[str, lc.Tool | None] = {}
        self.tool_info: dict[str, dict[str, str | None]] = {}
        for name in ("wrk", "h2load"):
            tool = lc.find_tool(name)
            version = tool.version() if tool else "not found"
            self.tools[name] = None if version.startswith(("not found", DOES_NOT_RUN)) else tool
            self.tool_info[name] = {"found": tool.describe() if tool else None,
                                    "version": version}
        self.routes = routes(self.tools)
        self.series: dict[str, dict[str, Any]] = {}
        self.single: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.starts_s: dict[str, float] = {}
        self.idle: dict[str, Any] = {}
        self.gen: Any = None

    def usable(self, path: str) -> str | None:
        """Why ``path`` cannot run here (a missing client or protocol), else None."""
        from loadtest.protocols import PROTOCOLS

        client, protocol = self.routes[path].client, self.routes[path].protocol
        if client in self.tools and self.tools[client] is None:
            return (f"{client}: {self.tool_info[client]['version']} (${lc.ENV_VARS[client]}, "
                    ".tools/bin/ or PATH; see bench/README.md)")
        if client == "gen" and protocol not in PROTOCOLS:
            return f"loadtest.protocols has no {protocol!r} protocol yet"
        return None

    def sweep(self, meter: Meter, path: str, workload: str, levels: list[int]) -> None:
        """Points at rising connections until one is not served at --stop-p99-ms."""
        name = f"{workload}/{path}"
        why = self.usable(path)
        if why is not None:
            self.skipped.append(f"{name}: {why}")
            print(f"SKIPPED {name}: {why}", flush=True)
            return
        if not self.afford(name, meter.cost_s(path)):
            return
        try:
            meter.check(path, workload)
        except Exception as exc:  # noqa: BLE001 - a path that does not answer is skipped, named
            self.failed(f"{name}: check failed", exc)
            return
        label = self.routes[path].label
        print(f"\n== {label}, workload {workload} ==", flush=True)
        points: list[dict] = []
        self.series[name] = {"path": path, "label": label, "client": self.routes[path].client,
                             "workload": workload, "points": points}
        for level in levels:
            if points and not self.afford(f"{name} at {level} connections", meter.cost_s(path)):
                break
            if not self.point(meter, name, path, workload, level, points):
                break

    def point(self, meter: Meter, name: str, path: str, workload: str, level: int,
              points: list[dict], seconds: int | None = None) -> bool:
        """One point appended to ``points``; False when the sweep should stop."""
        try:
            p = meter.measure(path, workload, level, seconds)
        except Exception as exc:  # noqa: BLE001 - a failed point ends its sweep, named; the run goes on
            self.failed(f"{name} at {level} connections", exc)
            if self.routes[path].client == "gen":  # its load processes may still be in that point
                meter.gen = self.renew_gen()
            return False
        points.append(p)
        print(report.point_line(p), flush=True)
        return served(p, self.args.stop_p99_ms)

    def renew_gen(self) -> Any:
        """Fresh load processes (after a failed point)."""
        from loadtest.gen import Generator

        if self.gen is not None:
            self.gen.close()
        self.gen = Generator(self.args.procs, self.args.gen_warmup_s, float(self.args.seconds))
        return self.gen

    def single_id(self, meter: Meter) -> None:
        """Workload c: one connection over --single-seconds (the latency figure), then sweeps."""
        for path in SINGLE_PATHS:
            name = f"c/{path}"
            cost = meter.cost_s(path, self.args.single_seconds)
            if self.usable(path) is None and self.afford(f"single id {path}", cost):
                out: list[dict] = []
                print(f"\n== single id, 1 connection, {self.routes[path].label} ==", flush=True)
                self.point(meter, name, path, "c", 1, out, self.args.single_seconds)
                if out:
                    self.single[name] = out[0]
        for path in SINGLE_PATHS:
            self.sweep(meter, path, "c", self.args.connections_c)


def daemon_config(run: Run, cfg: Any, npz: Path, grpc_port: int) -> Path:
    """The run's config: the saved .npz as graph, a gRPC port, everything else from --config."""
    return serve_config(cfg, npz, run.folder, fields={"server.grpc_port": grpc_port})


def idle_cpu(cpu: TreeCpu, standby: bool, window_s: float = 1.0,
             settle_s: float = SETTLE_S) -> dict[str, Any]:
    """The daemon's own CPU with no load (cores per process), once it has settled: its warm
    spares (``server.standby_processes``, spawned a few seconds after it is ready, then importing
    torch for seconds) seen when expected, and spares and other processes quiet for
    ``QUIET_WINDOWS`` windows in a row; else every first point would count their imports."""
    t0, quiet, seen = time.perf_counter(), 0, not standby
    while True:
        before = cpu.snap()
        time.sleep(window_s)
        usage = cpu.usage(before, cpu.snap())
        spare_ms = sum(v for k, v in usage.items() if role_class(k) in ("standby", "other"))
        seen = seen or any(role_class(k) == "standby" for k in usage)
        quiet = quiet + 1 if spare_ms / 1e3 / window_s < SETTLED_CORES else 0
        waited_s = time.perf_counter() - t0
        if (seen and quiet >= QUIET_WINDOWS) or waited_s > settle_s:
            break
    return {"settled": seen and quiet >= QUIET_WINDOWS, "settle_s": round(waited_s, 1),
            "cores": {k: round(v / 1e3 / window_s, 3) for k, v in usage.items()}}


def daemon_phase(run: Run, cfg: Any, npz: Path, work: Workloads) -> None:
    """Every path of the daemon: the first workload, single id, then the other workloads."""
    a = run.args
    paths = [p for p in DAEMON_PATHS if p in a.paths]
    grpc_port = free_port()
    if not run.afford("daemon", a.start_cost_s + 3 * a.seconds):
        return
    srv = Daemon(daemon_config(run, cfg, npz, grpc_port), log_path=run.folder / "server.log",
                 args=["--log-level", "warning"], grace_s=SERVER_GRACE_S)
    with run.serving(srv, "daemon", a.start_timeout_s) as ready_s:
        if ready_s is None:
            return
        run.starts_s["daemon"] = ready_s
        workers = srv.get_json("/v1/workers")["workers"]
        cpu = TreeCpu(srv.pid, workers)
        run.idle = {"workers": [{k: w.get(k) for k in ("role", "index")} for w in workers],
                    "http_workers": max(1, sum(w["role"] == "frontend" for w in workers)),
                    **idle_cpu(cpu, cfg.server.standby_processes > 0)}
        target = Target(cfg.model.name, srv.url, f"127.0.0.1:{grpc_port}")
        meter = Meter(a, run.folder, run.tools, run.gen, work, cpu, target)
        for i, workload in enumerate(a.workloads):
            for path in paths:
                cpu.set_workers(srv.get_json("/v1/workers")["workers"])
                run.sweep(meter, path, workload, a.connections)
            if i == 0 and not a.no_single:
                run.single_id(meter)
        run.idle["checks"] = {k: v for k, v in meter.checks.items() if v}


def queue_order(run: Run) -> tuple[list[str], list[str]]:
    """The queue API's workloads: those whose time is held from the start (the first
    workload's, single id's), then the others, measured when there is time left and the
    daemon's paths of that workload were measured."""
    first = [run.args.workloads[0], "c"]
    qw = run.args.queue_workloads
    return [w for w in first if w in qw], [w for w in qw if w not in first]


def queue_cost_s(run: Run, workloads: list[str]) -> float:
    """The queue API phase's expected time: the start, settling, the sweeps of ``workloads``."""
    a = run.args
    if "queue" not in a.paths or not workloads:
        return 0.0
    per_point = a.gen_warmup_s + a.seconds + 1.5
    levels = sum(len(a.connections_c if w == "c" else a.connections) for w in workloads)
    return a.start_cost_s + 10.0 + levels * per_point


def plan_s(run: Run) -> float:
    """The whole run's expected time at full sweeps (no early stop)."""
    a = run.args
    wrk_s = a.warmup_s + a.seconds + 0.7
    gen_s = a.gen_warmup_s + a.seconds + 1.5
    paths = [p for p in DAEMON_PATHS if p in a.paths and run.usable(p) is None]
    per_level = sum(gen_s if run.routes[p].client == "gen" else wrk_s for p in paths)
    single = 0.0 if a.no_single else 2 * (a.warmup_s + a.single_seconds + 0.7) + \
        2 * len(a.connections_c) * wrk_s
    daemon = a.start_cost_s + 10.0 + len(a.workloads) * len(a.connections) * per_level + single
    return daemon + queue_cost_s(run, sum(queue_order(run), []))


def queue_phase(run: Run, cfg: Any, graph: Any, work: Workloads) -> None:
    """The queue API: ``Pipeline`` in this process, the load processes connect to it."""
    from quiver_serve.engine.client.pipeline import Pipeline

    run.reserve_s = 0.0
    if "queue" not in run.args.paths or not run.afford("queue API", run.args.start_cost_s):
        return
    t0 = time.perf_counter()
    p = Pipeline(cfg, graph=graph).start()
    try:
        run.starts_s["queue API"] = time.perf_counter() - t0
        print(f"\nqueue API (Pipeline in this process) ready in {run.starts_s['queue API']:.1f} s",
              flush=True)
        pool = [proc.pid for proc in run.gen.pool.procs]
        cpu = TreeCpu(os.getpid(), p.workers(), exclude=pool)
        run.idle["queue_api"] = idle_cpu(cpu, cfg.server.standby_processes > 0)
        meter = Meter(run.args, run.folder, run.tools, run.gen, work, cpu,
                      Target(cfg.model.name, endpoints=p.endpoints()))
        held, later = queue_order(run)
        for workload in held + later:
            if workload in later and not any(s["workload"] == workload
                                             for s in run.series.values()):
                run.skipped.append(f"{workload}/queue: no other path of workload {workload} "
                                   "measured")
                continue
            levels = run.args.connections_c if workload == "c" else run.args.connections
            run.sweep(meter, "queue", workload, levels)
    finally:
        p.stop()


def single_id_levels(connections: list[int]) -> list[int]:
    """The single-id sweep's default: the others' levels, then 2x and 4x the last (the sweep
    stops past --stop-p99-ms, so the extra levels cost time only while p99 stays low)."""
    last = max(connections)
    return sorted(set(connections) | {2 * last, 4 * last})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.frontdoor.wrk_bench", __doc__)
    add_run_options(ap, budget_s=420.0, start_timeout_s=300.0)
    ap.add_argument("--workloads", nargs="+", choices=["a", "b"], help="default: a b (--smoke: a)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS),
                    default=[p for p in PATHS if p not in OPT_IN_PATHS],
                    help="default: all but grpc-one-body (h2load, one body: see above), "
                    "grpc-aio and grpc-stream-aio (grpc.aio's client)")
    ap.add_argument("--queue-workloads", nargs="+", choices=["a", "b", "c"],
                    help="the queue API's workloads (default: --workloads, and c unless --no-single)")
    ap.add_argument("--connections", type=int, nargs="+", help="closed-loop connections "
                    "(callers) per point, rising (default: 16 32 64 128 256; --smoke: 1 4 16)")
    ap.add_argument("--connections-c", type=int, nargs="+", help="the single-id sweep's "
                    "(default: --connections, then 2x and 4x the last)")
    ap.add_argument("--no-single", action="store_true", help="no single-id (c) points")
    ap.add_argument("--seconds", type=int, help="measured window per point, whole seconds "
                    "(default 3; --smoke: 1)")
    ap.add_argument("--warmup-s", type=int, default=1, help="wrk / h2load run before each point")
    ap.add_argument("--gen-warmup-s", type=float, default=0.5, help="loadtest.gen's warm-up")
    ap.add_argument("--single-seconds", type=int, help="the one-connection points (default 5; "
                    "--smoke: 2)")
    ap.add_argument("--bound-ms", type=float, default=10.0, help="the p99 bound of the table")
    ap.add_argument("--stop-p99-ms", type=float, default=30.0, help="a sweep stops past this")
    ap.add_argument("--client-threads", type=int, help="wrk / h2load threads (default: CPUs / 4, "
                    "1 to 4)")
    ap.add_argument("--bodies", type=int, default=4096, help="distinct requests per workload")
    ap.add_argument("--lua-statuses", action="store_true", help="wrk counts every status "
                    "(defines response(): more client CPU); default: status > 399 only")
    ap.add_argument("--start-cost-s", type=float, default=60.0, help="expected daemon start-up")
    args = ap.parse_args(argv)
    smoke = SMOKE if args.smoke else {}
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke.get(key, value))
    if args.smoke:
        procs, sets = args.procs, list(args.sets)
        smoke_settings(args, budget_s=300.0, start_timeout_s=args.start_timeout_s, procs=procs)
        args.sets, args.start_cost_s = sets, 30.0  # the config's own server settings
    args.connections_c = args.connections_c or smoke.get("connections_c") or \
        single_id_levels(args.connections)
    if args.queue_workloads is None:
        args.queue_workloads = args.workloads + ([] if args.no_single else ["c"])
    return args


def main(argv: list[str] | None = None) -> int:
    from loadtest.workloads import hot_set

    args = parse_args(argv)
    exit_on_sigterm()  # unwinds: daemon stopped, JSON written
    cfg = load_config(args.config, args.sets)
    out = result_path("wrk_bench", args, "smoke" if args.smoke else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="qs-wrk-bench-"))
    run = Run(args, folder)
    code = 0
    before, after = lc.raise_open_files()
    if after < 2 * max(args.connections + args.connections_c):
        print(f"warning: {after} open files allowed (was {before}): the largest sweeps may fail "
              "to connect", flush=True)
    try:
        graph, npz = save_graph(cfg, folder)
        graph.share_memory_()
        work = Workloads(graph.num_nodes, hot_set(graph.degree().numpy()), args.bodies)
        run.renew_gen()
        print(report.banner(run), flush=True)
        run.reserve_s = queue_cost_s(run, queue_order(run)[0])
        print(f"plan: ~{plan_s(run):.0f} s at full sweeps (graph built in "
              f"{time.perf_counter() - run.t0:.0f} s); budget {args.budget_s:.0f} s, "
              f"{run.reserve_s:.0f} s of it held for the queue API", flush=True)
        phases = (("daemon", lambda: daemon_phase(run, cfg, npz, work)),
                  ("queue API", lambda: queue_phase(run, cfg, graph, work)))
        for name, phase in phases:
            try:
                phase()
            except SystemExit as exc:  # SIGTERM: keep what was measured
                run.skipped.append(f"cut short (exit {exc.code})")
                code = 1
                break
            except Exception as exc:  # noqa: BLE001 - the next phase runs; the JSON is written
                run.failed(f"{name} phase", exc)
                code = 1
        report.finish(run, cfg, graph, out)
        return code
    finally:
        if run.gen is not None:
            run.gen.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
