"""The CPU-box target of ``python -m bench.engine.pipeline --cpu-efficiency``: on one daemon, many
small requests (64 callers x 48 ids) against few large ones (2 callers x 4,096 ids), and the
single-id latency of one caller, on three paths:

- load processes: other processes, each a fast-path client (``connect_async`` + ``submit_async``);
- ``Pipeline.embed_async``: coroutines on one event loop in this process (its ``LoopClient``);
- ``Pipeline.embed``: threads in this process, each blocking on its call (the IO-thread client).

Efficiency = small-request seeds/s over large-request seeds/s of the same path and run. Each point
in this process also reports, over its measured window, the micro-batches the clients sent per
second and the requests per micro-batch, and the CPU (cores) this process, the engine cores and
the CPU samplers used (``/proc``), since on a 2-core box what the caller burns the engine lacks.
This process treats its own garbage collector as the load processes do (decision 5): its heap is
frozen once the daemon is up and no automatic collection runs inside a point (one full
collection of its unfrozen heap took ~190 ms and landed in one point's p99).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from bench.engine.pipeline import print_daemon_row
from loadtest.cpu import CLK_TCK, read_stat
from loadtest.driver import closed_loop
from loadtest.engine_probe import DaemonLoad, merge_point
from loadtest.stats import fmt, percentiles_ms
from loadtest.workloads import draw_requests
from quiver_serve.config import ServeConfig

#: (name, ids per request, callers) of each point
POINTS = [("small", 48, 64), ("large", 4096, 2), ("single", 1, 1)]
ERROR_BACKOFF_S = 0.01


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    stat = read_stat(pid)
    return stat[1] / CLK_TCK if stat is not None else 0.0


class WindowProbe:
    """At ``win0`` and ``win1`` (wall clock) a thread notes the micro-batches sent by the
    pipeline's clients and the CPU seconds of this process and of each child role."""

    def __init__(self, p: Any, win0: float, win1: float) -> None:
        self.p, self.win0, self.win1 = p, win0, win1
        self.snaps: list[tuple[int, Counter]] = []
        self._thread = threading.Thread(target=self._run, name="bench-window", daemon=True)
        self._thread.start()

    def _snap(self) -> tuple[int, Counter]:
        cpu: Counter = Counter(caller=time.process_time())
        for w in self.p.workers():
            if w["pid"] is not None:
                cpu[w["role"]] += cpu_seconds(w["pid"])
        return sum(sum(c.sent) for c in self.p.clients()), cpu

    def _run(self) -> None:
        for at in (self.win0, self.win1):
            time.sleep(max(at - time.time(), 0.0))
            self.snaps.append(self._snap())

    def result(self, ok: int) -> dict:
        self._thread.join(timeout=max(self.win1 - time.time(), 0.0) + 5.0)
        if len(self.snaps) < 2:
            return {}
        seconds = self.win1 - self.win0
        (sent0, cpu0), (sent1, cpu1) = self.snaps
        batches = sent1 - sent0
        return {"micro_batches_per_s": batches / seconds,
                "requests_per_micro_batch": ok / batches if batches else None,
                "cpu_cores": {k: round((cpu1[k] - cpu0[k]) / seconds, 3) for k in cpu1}}


def embed_coroutines(p: Any, reqs: np.ndarray, callers: int, win0: float, win1: float) -> dict:
    """Closed-loop coroutines of ``Pipeline.embed_async`` on one event loop (the driver's loop)."""
    from quiver_serve.errors import ServeError

    async def call(i: int) -> str:
        try:
            await p.embed_async(reqs[i])
        except ServeError as exc:  # refused at admission: counted by status
            return str(exc.info.status)
        return "200"

    res = asyncio.run(closed_loop(call, np.full(len(reqs), reqs.shape[1]), callers, win0, win1))
    return {"lat": res["lat_s"], "status": {int(k) if k.isdigit() else k: n
                                            for k, n in res["status"].items()}}


def embed_threads(p: Any, reqs: np.ndarray, callers: int, win0: float, win1: float) -> dict:
    """Closed-loop threads, each calling ``Pipeline.embed`` (blocking) in turn."""
    from quiver_serve.errors import ServeError

    off = time.time() - time.perf_counter()
    w0, w1 = win0 - off, win1 - off
    order, n = itertools.count(), len(reqs)
    lats: list[list[float]] = [[] for _ in range(callers)]
    statuses: list[Counter] = [Counter() for _ in range(callers)]

    def caller(k: int) -> None:
        while (t0 := time.perf_counter()) < w1:
            try:
                p.embed(reqs[next(order) % n])
                status = 200
            except ServeError as exc:
                status = exc.info.status
            done = time.perf_counter()
            if w0 <= done < w1:
                lats[k].append(done - t0)
                statuses[k][status] += 1
            if status != 200:
                time.sleep(ERROR_BACKOFF_S)

    threads = [threading.Thread(target=caller, args=(k,), name=f"bench-caller{k}", daemon=True)
               for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(w1 - time.perf_counter(), 0.0) + p.cfg.server.request_timeout_s + 10.0)
    return {"lat": np.asarray([x for lat in lats for x in lat]), "status": sum(statuses, Counter())}


def embed_point(p: Any, k: int, callers: int, threads: bool, args: argparse.Namespace) -> dict:
    from quiver_serve.engine.procs.heap import collections_paused

    reqs = draw_requests("b", 256, k, p.num_nodes, np.zeros(1, np.int64), np.random.default_rng(k))
    win0 = time.time() + args.warmup
    win1 = win0 + args.seconds
    probe = WindowProbe(p, win0, win1)
    drive = embed_threads if threads else embed_coroutines
    with collections_paused():
        res = drive(p, reqs, callers, win0, win1)
    status = Counter(res["status"])
    ok = status.pop(200, 0)
    return {"ids_per_request": k, "callers": callers, "ok": ok, "seeds_per_s": ok * k / args.seconds,
            "errors": {str(s): n for s, n in status.items()}, **percentiles_ms(res["lat"]),
            **probe.result(ok)}


def print_embed_row(label: str, r: dict) -> None:
    cores = " ".join(f"{k} {v:.2f}" for k, v in sorted(r.get("cpu_cores", {}).items()))
    print(f"{label:7s} {r['ids_per_request']:4d} ids x {r['callers']:3d} callers: "
          f"{r['seeds_per_s']:11,.0f} seeds/s  p50 {fmt(r['p50_ms'])} p99 {fmt(r['p99_ms'])} ms  "
          f"{fmt(r.get('micro_batches_per_s'), ',.0f')} micro-batches/s x "
          f"{fmt(r.get('requests_per_micro_batch'), '.1f')} req  cpu [{cores}]  "
          f"errors {r['errors'] or 0}", flush=True)


def cpu_efficiency(p: Any, pool: DaemonLoad, args: argparse.Namespace, timeout_s: float) -> dict:
    """Every point of ``POINTS`` on each path (see the module docstring)."""
    out: dict[str, dict] = {"load_procs": {}, "embed_async": {}, "embed_threads": {}}
    for name, k, callers in POINTS:
        parts = pool.run("b", k, callers, args.warmup, args.seconds, timeout_s)
        out["load_procs"][name] = merge_point(parts, "b" if k > 1 else "c", k, callers, args.seconds, 1)
        print_daemon_row(out["load_procs"][name])
    for key, threads, label in (("embed_async", False, "async"), ("embed_threads", True, "sync")):
        for name, k, callers in POINTS:
            out[key][name] = r = embed_point(p, k, callers, threads, args)
            print_embed_row(label, r)
    for path in out.values():
        path["efficiency"] = path["small"]["seeds_per_s"] / max(path["large"]["seeds_per_s"], 1e-9)
    return out


def print_cpu_efficiency(res: dict) -> None:
    print("\n| path | 64 callers x 48 ids, seeds/s (p50 / p99 ms) | 2 callers x 4,096 ids, "
          "seeds/s | efficiency (target >= 0.6) | single-id p50 / p99 ms |")
    print("|---|---|---|---|---|")
    names = {"load_procs": "load processes (connect_async + submit_async)",
             "embed_async": "Pipeline.embed_async (coroutines)",
             "embed_threads": "Pipeline.embed (threads)"}
    for key, label in names.items():
        r = res[key]
        s = r["small"]
        print(f"| {label} | {s['seeds_per_s']:,.0f} ({fmt(s['p50_ms'])} / {fmt(s['p99_ms'])}) | "
              f"{r['large']['seeds_per_s']:,.0f} | {r['efficiency']:.2f} | "
              f"{fmt(r['single']['p50_ms'])} / {fmt(r['single']['p99_ms'])} |")


def run_cpu_efficiency(cfg: ServeConfig, graph: Any, hot: np.ndarray, args: argparse.Namespace) -> dict:
    from quiver_serve.engine.client.pipeline import Pipeline
    from quiver_serve.engine.procs.heap import freeze_startup_heap

    p = Pipeline(cfg, graph=graph).start()
    pool = None
    try:
        freeze_startup_heap("bench")
        pool = DaemonLoad(p.endpoints(), args.procs, hot, graph.num_nodes)
        res = cpu_efficiency(p, pool, args, cfg.server.request_timeout_s)
    finally:
        if pool is not None:
            pool.close()
        p.stop()
    return {"cpu_efficiency": res}
