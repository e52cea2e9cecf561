#!/usr/bin/env python
"""The exact table (docs/architecture.md, "The exact table") vs exact embeddings computed on the
fly: serving, build, refresh.

One run, the project and its baseline side by side, the load from the load generator's processes
(``loadtest/``), the graph of --config saved once as an .npz every daemon loads:

1. serving: a daemon with ``exact.materialize=on`` and (the baseline) one with ``off``, started
   one after the other from the same config (``server.py``; the baseline's request deadline raised
   to --baseline-timeout-s). Exact requests of 48 ids uniform over every node, over HTTP npy and
   over the queue API (``Pipeline`` started in this process from the same config, load processes
   connected to it), closed-loop callers at --levels (the baseline: --baseline-levels, short
   windows); sampled requests of the same shape on the table's daemons too, and on the
   baseline's HTTP daemon (what the table costs sampled serving). Per point p50 / p99 / p99.9,
   req/s, ids/s; per series the most req/s at p99 <= --bound-ms;
2. build: the table's build time and bytes at the table daemon's start (``GET /v1/graph``, else
   ``/metrics``, else its log), and for each --build-configs (a config path and/or
   ``section.key=value`` overrides of --config, space-separated in one argument) the daemon's
   start alone, table on;
3. refresh under updates, on the table daemon: updater processes (``loadtest/updater.py``)
   posting edge batches at --update-rate while the load serves sampled requests at
   --load-fraction of step 1's sampled HTTP capacity, one window per --exact-rates (exact
   requests beside, from their own load process; 0: none): acknowledged edge updates/s, table
   staleness (histogram, polled version lag and stale rows), rows refreshed/s, exact requests
   from the table vs on the fly, embed latency, 5xx.

Budgeted (--budget-s): a step that would start past it is skipped and named. The JSON goes to
--out, else --out-dir (default $OUT, else bench/results/) as exact_table_<machine>_<date>
[_<variant>].json; a table is printed last.

    python -m bench.graph.exact_table                 # Reddit-scale, configs/bench_reddit.yaml
    python -m bench.graph.exact_table --smoke         # Cora on a CPU box, about a minute
    python -m bench.gpu exact                         # the GPU runner's suite
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.graph import table_watch as tw
from bench.graph.exact_refresh import add_refresh_options, refresh_step
from bench.graph.exact_report import build_line, print_report, targets
from loadtest import promdiff, watch
from loadtest.gen import Generator
from loadtest.harness import Daemon, Session, config_yaml, saved_graph_facts
from loadtest.results import (
    Budget,
    add_run_options,
    doc_parser,
    exit_on_sigterm,
    load_config,
    result_path,
    run_meta,
    smoke_settings,
    write_result,
)
from loadtest.stats import best_under

SERVER_GRACE_S = 8.0
MODES = {"table": "on", "on_the_fly": "off"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.graph.exact_table", __doc__)
    add_run_options(ap, budget_s=540.0, start_timeout_s=600.0)
    ap.add_argument("--protocols", nargs="+", default=["http-npy", "queue"],
                    choices=["http-npy", "http-json", "queue"])
    ap.add_argument("--ids-per-request", type=int, default=48)
    ap.add_argument("--levels", type=float, nargs="+", default=[1, 4, 16, 64, 128, 256],
                    help="closed-loop callers of the table's series")
    ap.add_argument("--baseline-levels", type=float, nargs="+", default=[1, 16],
                    help="closed-loop callers of the on-the-fly series")
    ap.add_argument("--bound-ms", type=float, default=10.0, help="throughput at p99 <= this")
    ap.add_argument("--stop-p99-ms", type=float, default=50.0,
                    help="a table series stops after a point above this p99")
    ap.add_argument("--seconds", type=float, default=2.0, help="window of a table point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--baseline-seconds", type=float, default=4.0)
    ap.add_argument("--baseline-warmup", type=float, default=2.0)
    ap.add_argument("--baseline-timeout-s", type=float, default=60.0,
                    help="client timeout and the baseline daemon's server.request_timeout_s")
    ap.add_argument("--no-sampled", action="store_true", help="no sampled series")
    ap.add_argument("--no-baseline-sampled", action="store_true",
                    help="no sampled series on the baseline's HTTP daemon")
    ap.add_argument("--build-configs", nargs="*", default=None, metavar="SPEC",
                    help="configs whose start (table build) alone is measured: a path and/or "
                         "section.key=value overrides of --config, space-separated in one "
                         "argument (default: graph.synthetic_preset=products; smoke: none)")
    add_refresh_options(ap)
    ap.add_argument("--admin-token", help="server.admin_token, sent as the bearer token")
    ap.add_argument("--poll-interval-s", type=float, default=0.1)
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args)
    elif args.build_configs is None:
        args.build_configs = ["graph.synthetic_preset=products"]
    return args


def smoke(args: argparse.Namespace) -> None:
    """Cora, tiny levels and windows; the pure-torch sampler (no C++ build in the time)."""
    smoke_settings(args, budget_s=170.0)  # inside the smoke test's 240 s on a busy 2-core box
    args.levels, args.baseline_levels = [1, 4], [1, 2]
    args.seconds, args.warmup, args.baseline_seconds, args.baseline_warmup = 0.8, 0.3, 0.8, 0.3
    args.baseline_timeout_s, args.refresh_seconds = min(args.baseline_timeout_s, 20.0), 1.5
    args.update_rate, args.edges_per_call, args.update_procs = 500.0, 100, 1
    args.exact_rates, args.load_fraction = [0.0, 10.0], min(args.load_fraction, 0.5)
    args.build_configs = args.build_configs or []


class Run(Budget):
    """The run's state: budget, load processes, the graph's facts, results."""

    def __init__(self, args: argparse.Namespace, cfg: Any, npz: Path, folder: Path, facts: dict,
                 gen: Generator, t0: float) -> None:
        super().__init__(args.budget_s, t0)
        self.args, self.cfg, self.npz, self.folder, self.facts = args, cfg, npz, folder, facts
        self.gen = gen
        self.headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
        self.series: list[dict[str, Any]] = []
        self.builds: list[dict[str, Any]] = []
        self.refresh: list[dict[str, Any]] = []
        self.starts_s: list[float] = []

    @property
    def start_s(self) -> float:
        """A daemon's start: the slowest measured, else a guess."""
        return max(self.starts_s, default=15.0 if self.args.smoke else 90.0)

    def sweep_cost_s(self, slow: bool) -> float:
        """A series' time; ``slow``: exact requests on the fly (the baseline's levels)."""
        a = self.args
        if not slow:
            return len(a.levels) * (a.seconds + a.warmup + 1.5)
        drain_s = min(a.baseline_timeout_s, 10.0)  # a closed loop waits for its last answers
        return len(a.baseline_levels) * (a.baseline_seconds + a.baseline_warmup + drain_s)

    def spec(self, exact: bool) -> dict[str, Any]:
        return {"workload": "b", "hot": None, "num_nodes": self.facts["num_nodes"], "seed": 0,
                "ids_per_request": self.args.ids_per_request, "exact": exact}

    def target(self, protocol: str, slow: bool, url: str = "",
               endpoints: Any = None) -> dict[str, Any]:
        timeout_s = self.args.baseline_timeout_s if slow else self.args.timeout_s
        return {"protocol": protocol, "url": url, "model": self.facts["model"],
                "timeout_s": timeout_s, "http_client": "aiohttp", "endpoints": endpoints}

    def mode_config(self, mode: str, tag: str) -> Any:
        """--config on the saved graph, the table on or off, its own update log."""
        c = self.cfg.model_copy(deep=True)
        c.graph.format, c.graph.path = "npz", str(self.npz)
        c.graph.update_log_dir = str(self.folder / f"graph-state-{mode}-{tag}")
        c.exact.materialize = MODES[mode]
        if mode == "on_the_fly":
            c.server.request_timeout_s = max(c.server.request_timeout_s,
                                             self.args.baseline_timeout_s)
        if self.args.admin_token:
            c.server.admin_token = self.args.admin_token
        return c


def write_config(cfg: Any, path: Path) -> Path:
    path.write_text(config_yaml(cfg))  # YAML quotes 'on' / 'off'
    return path


def sweep(run: Run, mode: str, protocol: str, exact: bool, metrics: Any,
          **where: Any) -> None:
    """One closed-loop series against ``where`` (``url=`` or ``endpoints=``); the exact table's
    counters read around it (``metrics``: a callable returning the metrics text, or None)."""
    a, gen = run.args, run.gen
    slow = mode == "on_the_fly" and exact
    name = f"{mode} {protocol} {'exact' if exact else 'sampled'}"
    if not run.afford(name, run.sweep_cost_s(slow)):
        return
    gen.warm_s = a.baseline_warmup if slow else a.warmup
    gen.seconds = a.baseline_seconds if slow else a.seconds
    levels = a.baseline_levels if slow else a.levels
    print(f"\n== {name}: closed loop, callers {' '.join(f'{v:g}' for v in levels)} ==",
          flush=True)
    before = metrics() if metrics else None
    t_start = time.perf_counter()
    target = run.target(protocol, slow, **where)
    res = gen.sweep(target, run.spec(exact), "closed", levels,
                    float("inf") if slow else a.stop_p99_ms, [a.bound_ms],
                    target["url"] if protocol != "queue" else "local",
                    deadline=run.t0 + a.budget_s - run.sweep_cost_s(slow) / len(levels))
    time.sleep(0.2)  # the engine cores publish their counters every 50 ms
    after = metrics() if metrics else None
    points = res["points"]
    best = best_under(points, a.bound_ms)
    top = max(points, key=lambda p: p["req_per_s"]) if points else None
    run.series.append({
        "mode": mode, "protocol": protocol, "request": "exact" if exact else "sampled",
        "points": points, "under_bound": brief(best), "most": brief(top),
        "counters": tw.counters_window(before, after, time.perf_counter() - t_start)})


def brief(p: dict | None) -> dict | None:
    if p is None:
        return None
    return {k: p[k] for k in ("level", "req_per_s", "seed_nodes_per_s", "p50_ms", "p99_ms",
                              "p999_ms")}


@contextlib.contextmanager
def http_daemon(run: Run, mode: str) -> Iterator[Daemon | None]:
    """``server.py`` on the mode's config (None when its start does not fit the budget); its
    start time and table build recorded."""
    if not run.afford(f"{mode} daemon", run.start_s + run.sweep_cost_s(mode == "on_the_fly")):
        yield None
        return
    path = write_config(run.mode_config(mode, "http"), run.folder / f"serve_{mode}.yaml")
    d = Daemon(path, log_path=run.folder / f"server_{mode}.log", name=f"quiver-serve ({mode})",
               grace_s=SERVER_GRACE_S, ready_timeout_s=min(run.args.start_timeout_s,
                                                           max(run.left_s(), 30.0)))
    try:
        ready_s = d.wait_ready(headers=run.headers)
    except (RuntimeError, TimeoutError) as exc:
        d.stop()
        start_failed(run, f"{mode} daemon", exc)
        yield None
        return
    try:
        run.starts_s.append(ready_s)
        print(f"\n{mode} daemon (exact.materialize={MODES[mode]}) ready in {ready_s:.1f} s",
              flush=True)
        if mode == "table" and not run.builds:
            record_build(run, "--config (http daemon)", d, ready_s)
        yield d
    finally:
        d.stop()


def start_failed(run: Run, what: str, exc: BaseException) -> None:
    """A start that failed is named (the step skipped); the run goes on."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    run.skipped.append(f"{what}: start failed ({first})")
    print(f"FAILED {what}: {exc}", flush=True)


def record_build(run: Run, label: str, d: Daemon, ready_s: float) -> dict[str, Any]:
    _, graph = watch.http_json(d.url + watch.GRAPH_PATH, headers=run.headers)
    info = tw.build_info(graph, promdiff.scrape(d.url), d.log(1 << 24))
    row = {"config": label, "ready_s": ready_s, **info}
    run.builds.append(row)
    print(build_line(row), flush=True)
    return row


@contextlib.contextmanager
def queue_pipeline(run: Run, mode: str) -> Iterator[Any]:
    """The queue API: ``Pipeline`` in this process on the mode's config (None when its start
    does not fit the budget)."""
    from quiver_serve.engine.client.pipeline import Pipeline

    if not run.afford(f"{mode} queue API",
                      run.start_s + run.sweep_cost_s(mode == "on_the_fly")):
        yield None
        return
    t0 = time.perf_counter()
    p = Pipeline(run.mode_config(mode, "queue"))
    try:
        p.start()
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        with contextlib.suppress(Exception):
            p.stop()
        start_failed(run, f"{mode} queue API", exc)
        yield None
        return
    try:
        run.starts_s.append(time.perf_counter() - t0)
        print(f"\n{mode} Pipeline (queue API, exact.materialize={MODES[mode]}) ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        yield p
    finally:
        p.stop()


def serving_http(run: Run, protocol: str) -> None:
    """The table daemon (exact, sampled, then the refresh step), then the baseline daemon."""
    for mode in MODES:
        with http_daemon(run, mode) as d:
            if d is None:
                continue
            scrape = (lambda d=d: promdiff.scrape(d.url)) if mode == "table" else None
            sweep(run, mode, protocol, True, scrape, url=d.url)
            if sampled_on(run, mode, protocol):
                sweep(run, mode, protocol, False, scrape, url=d.url)
            if mode == "table" and not run.args.no_refresh and not run.refresh:
                refresh_step(run, d)


def serving_queue(run: Run) -> None:
    for mode in MODES:
        with queue_pipeline(run, mode) as p:
            if p is None:
                continue
            local = promdiff.local_text if mode == "table" else None  # no table: no counters
            sweep(run, mode, "queue", True, local, endpoints=p.endpoints())
            if sampled_on(run, mode, "queue"):
                sweep(run, mode, "queue", False, local, endpoints=p.endpoints())


def sampled_on(run: Run, mode: str, protocol: str) -> bool:
    """Sampled series: on the table's daemons; on the baseline's first HTTP one too (what the
    table costs sampled serving), unless --no-baseline-sampled."""
    a = run.args
    if a.no_sampled:
        return False
    if mode == "table":
        return True
    first_http = next((p for p in a.protocols if p != "queue"), None)
    return protocol == first_http and not a.no_baseline_sampled


def build_configs(run: Run) -> None:
    """Each --build-configs: the daemon's start alone, table on; then stopped."""
    for i, spec in enumerate(run.args.build_configs or []):
        tokens = spec.split()
        paths = [t for t in tokens if "=" not in t]
        sets = run.args.sets + [t for t in tokens if "=" in t]
        if not run.afford(f"build {spec!r}", max(2.0 * run.start_s, 60.0)):
            continue
        c = load_config(paths[0] if paths else run.args.config, sets)
        c.exact.materialize = "on"
        c.graph.update_log_dir = str(run.folder / f"graph-state-build-{i}")
        path = write_config(c, run.folder / f"build_{i}.yaml")
        d = Daemon(path, log_path=run.folder / f"build_{i}.log", name=f"quiver-serve ({spec})",
                   grace_s=SERVER_GRACE_S,
                   ready_timeout_s=min(run.args.start_timeout_s, max(run.left_s(), 30.0)))
        try:
            ready_s = d.wait_ready(headers=run.headers)
            record_build(run, spec, d, ready_s)
        except (RuntimeError, TimeoutError) as exc:
            start_failed(run, f"build {spec!r}", exc)
        finally:
            d.stop()


def phases(run: Run) -> None:
    """HTTP daemons (the refresh step inside the table's), the queue API, then the builds."""
    for protocol in run.args.protocols:
        if protocol != "queue":
            serving_http(run, protocol)
    if "queue" in run.args.protocols:
        serving_queue(run)
    build_configs(run)


def meta(args: argparse.Namespace, cfg: Any, facts: dict) -> dict[str, Any]:
    return run_meta(
        args, cfg, graph=facts["graph"], exact=cfg.exact.model_dump(mode="json"),
        workload=f"b ({args.ids_per_request} ids uniform over every node), closed loop",
        protocols=args.protocols, levels=args.levels, baseline_levels=args.baseline_levels,
        bound_ms=args.bound_ms, seconds=args.seconds, baseline_seconds=args.baseline_seconds,
        baseline_request_timeout_s=max(cfg.server.request_timeout_s, args.baseline_timeout_s),
        load_fraction=args.load_fraction, sampled_rate=args.sampled_rate,
        exact_rates=args.exact_rates, update_rate=args.update_rate,
        edges_per_call=args.edges_per_call, load_procs=args.procs,
        update_procs=args.update_procs)


def finish(run: Run | None, info: dict, out: Path, skipped: list[str], t0: float) -> None:
    """The JSON, then the tables printed last."""
    series = run.series if run else []
    result = {"meta": info, "series": series,
              "targets": targets(series, run.args.bound_ms) if run else {},
              "builds": run.builds if run else [], "refresh": run.refresh if run else [],
              "skipped": skipped + (run.skipped if run else []),
              "wall_s": time.perf_counter() - t0}
    write_result(out, result)
    print(f"wall {result['wall_s']:.0f} s")
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]))
    print_report(result)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    if args.smoke:
        os.environ["QUIVER_SERVE_DISABLE_CPP"] = "1"  # the daemons and the in-process Pipeline
    cfg = load_config(args.config, args.sets)
    out = result_path("exact_table", args, "smoke" if args.smoke else None)
    run, info, s = None, {}, Session("qs-exact-")
    try:
        with s:
            npz, facts = saved_graph_facts(cfg, s.folder)
            info = meta(args, cfg, facts)
            gen = s.own(Generator(args.procs, args.warmup, args.seconds))
            run = Run(args, cfg, npz, s.folder, facts, gen, s.t0)
            phases(run)
    finally:
        finish(run, info, out, s.skipped, s.t0)
    return s.code


if __name__ == "__main__":
    sys.exit(main())
