"""Load processes of the daemon benchmarks (``bench_pipeline``, ``bench_routing_daemon``).

P spawned processes, each running closed-loop asyncio callers of the queue API's fast-path client
(``connect_async``, driven by the point's own event loop), started at one wall-clock instant;
after a warm-up only requests that complete inside the common window count. Each reports its
latencies, statuses, its own CPU use, the batches the engine formed (from the stats-bearing
replies, via a ``PipelineObserver``) and its part of the tail trace (``bench/tail_trace.py``).
No automatic collection runs inside a window (``heap.collections_paused``): a load process's own
pauses are the harness's, not the daemon's.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from bench.tail_trace import (
    TripLog,
    daemon_gc_diff,
    daemon_gc_snapshot,
    loop_lag,
    merge_reports,
    process_report,
)
from loadtest.driver import close_processes
from loadtest.workloads import REQUEST_POOL, draw_requests
from quiver_serve.engine.heap import collections_paused, freeze_startup_heap
from quiver_serve.engine.observer import PipelineObserver


def latency_ms(lat: np.ndarray | list[float]) -> dict[str, float | None]:
    lat = np.asarray(lat, dtype=np.float64)
    if lat.size == 0:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    p50, p90, p99 = np.percentile(lat, [50, 90, 99]) * 1e3
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}


class BatchCounter(PipelineObserver):
    """Sums the per-batch stats that reach this client (one stats-bearing reply per batch)."""

    def __init__(self) -> None:
        self.batches = self.seeds = self.sampled = 0
        self.compute_s = self.sample_s = 0.0
        self.routes: Counter = Counter()
        self.log = TripLog()  # the tail trace (bench/tail_trace.py)

    def on_transport(self, sent_s: float, engine_received_s: float, engine_replied_s: float,
                     received_s: float) -> None:
        self.log.add_trip(sent_s, engine_received_s, engine_replied_s, received_s)

    def on_round_trip(self, sent_s: float, received_s: float) -> None:
        self.log.add_round_trip(sent_s, received_s)

    def on_batch(self, stats: Any) -> None:
        self.log.add_batch(stats)
        self.batches += 1
        self.seeds += stats.num_seeds
        self.sampled += stats.num_sampled_nodes
        self.compute_s += stats.compute_s
        self.sample_s += stats.sample_s
        self.routes[stats.route] += 1
        self.routes[f"engine{stats.worker}"] += 1  # batches per engine core, shown with routes

    def snapshot(self) -> tuple[np.ndarray, Counter]:
        return np.array([time.process_time(), self.batches, self.seeds, self.sampled,
                         self.compute_s, self.sample_s]), Counter(self.routes)


async def closed_loop(call: Any, reqs: np.ndarray, callers: int, win0: float, win1: float,
                      lat: list[float], status: Counter) -> None:
    """``callers`` closed-loop callers of ``await call(ids) -> status``; records what completes
    inside [win0, win1). A refusal at admission (pending full, shutting down) counts its status."""
    from quiver_serve.errors import ServeError

    async def caller(i: int) -> None:
        j = i * 7919
        while time.time() < win1:
            j += 1
            t0 = time.perf_counter()
            try:
                code = await call(reqs[j % len(reqs)])
            except ServeError as exc:
                code = exc.info.status
                await asyncio.sleep(0.001)
            if win0 <= time.time() < win1:
                status[code] += 1
                if code == 200:
                    lat.append(time.perf_counter() - t0)

    await asyncio.gather(*[caller(i) for i in range(callers)])


async def drive(client: Any, obs: BatchCounter, reqs: np.ndarray, cmd: dict) -> dict:
    """``cmd['callers']`` closed-loop callers from ``t_start``; counts completions in the window."""
    win0 = cmd["t_start"] + cmd["warm_s"]
    win1 = win0 + cmd["seconds"]
    lat: list[float] = []
    status: Counter = Counter()
    snaps: list[tuple[np.ndarray, Counter]] = []
    lags_ms: list[float] = []
    pauses: list[tuple[int, float]] = []

    async def call(ids: np.ndarray) -> int:
        res = await client.submit_async(ids)
        return 200 if res.ok else res.error.status

    async def window() -> None:
        await asyncio.sleep(max(0.0, win0 - time.time()))
        snaps.append(obs.snapshot())
        obs.log.start()
        await loop_lag(win1, lags_ms)
        await asyncio.sleep(max(0.0, win1 - time.time()))
        pauses.extend(obs.log.stop())
        snaps.append(obs.snapshot())

    await asyncio.sleep(max(0.0, cmd["t_start"] - time.time()))
    with collections_paused():  # this process's own collections are not the daemon's latency
        await asyncio.gather(window(), closed_loop(call, reqs, cmd["callers"], win0, win1, lat,
                                                   status))
    d = snaps[1][0] - snaps[0][0]
    lat_s = np.asarray(lat)
    return {"lat": lat_s, "status": dict(status), "cpu_frac": float(d[0]) / cmd["seconds"],
            "tail": process_report(obs.log, lat_s, lags_ms, pauses, cmd["tail_ms"]),
            "batches": int(d[1]), "seeds": int(d[2]), "sampled": int(d[3]),
            "compute_s": float(d[4]), "sample_s": float(d[5]), "routes": snaps[1][1] - snaps[0][1],
            "sent_per_engine": list(client.sent), "answered_per_engine": list(client.answered),
            "load_per_engine": list(client._load)}


async def drive_point(endpoints: Any, obs: BatchCounter, reqs: np.ndarray, cmd: dict) -> dict:
    """One point on a client driven by this point's event loop (``connect_async``: the
    queue API's coroutine path, no IO thread)."""
    from quiver_serve.engine.pipeline import connect_async

    client = connect_async(endpoints, obs)
    try:
        return await drive(client, obs, reqs, cmd)
    finally:
        client.stop()


def load_main(index: int, endpoints: Any, hot: np.ndarray, num_nodes: int, cmds: Any, out: Any) -> None:
    """A load process: run each point it is sent until it gets None."""
    torch.set_num_threads(1)
    obs = BatchCounter()
    freeze_startup_heap(f"load {index}")  # no ~100 ms full collections inside a measurement
    out.put({"ready": index})
    while (cmd := cmds.get()) is not None:
        k = cmd["k"]
        n = max(16, min(REQUEST_POOL, (1 << 20) // k))
        rng = np.random.default_rng(cmd["seed"])
        reqs = draw_requests(cmd["workload"], n, k, num_nodes, hot, rng)
        out.put({"index": index, **asyncio.run(drive_point(endpoints, obs, reqs, cmd))})


class LoadPool:
    """P spawned load processes kept for the whole sweep; ``run`` measures one point."""

    def __init__(self, endpoints: Any, procs: int, hot: np.ndarray, num_nodes: int) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=load_main, name=f"bench-load-{i}", daemon=True,
                                  args=(i, endpoints, hot, num_nodes, self.cmds[i], self.out))
                      for i in range(procs)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.out.get(timeout=300)

    def run(self, workload: str, k: int, callers: int, warm_s: float, seconds: float,
            timeout_s: float, tail_ms: float = 20.0) -> list[dict]:
        """One point; each part carries its tail trace, and ``daemon_gc``: the daemon processes'
        collections during the point (bench/tail_trace.py)."""
        n = max(1, min(len(self.procs), callers))
        share = [callers // n + (1 if i < callers % n else 0) for i in range(n)]
        gc_before = daemon_gc_snapshot()
        t_start = time.time() + 0.3  # every process starts its callers at this instant
        for i, c in enumerate(share):
            self.cmds[i].put({"workload": workload, "k": k, "callers": c, "seed": 1000 * callers + i,
                              "t_start": t_start, "warm_s": warm_s, "seconds": seconds,
                              "tail_ms": tail_ms})
        parts = [self.out.get(timeout=warm_s + seconds + timeout_s + 60) for _ in range(n)]
        time.sleep(0.1)  # the engine cores flush their pauses every 50 ms
        gc_diff = daemon_gc_diff(gc_before, daemon_gc_snapshot(), tail_ms)
        for part in parts:
            part["daemon_gc"] = gc_diff
        return parts

    def close(self) -> None:
        close_processes(self.cmds, self.procs)


def merge_point(parts: list[dict], workload: str, k: int, callers: int, seconds: float,
                engines: int) -> dict:
    """One daemon point from its load processes' reports."""
    lat = np.concatenate([p["lat"] for p in parts]) if parts else np.zeros(0)
    status: Counter = Counter()
    routes: Counter = Counter()
    for p in parts:
        status.update(p["status"])
        routes.update(p["routes"])
    ok = status.pop(200, 0)
    batches = sum(p["batches"] for p in parts)
    tail = merge_reports([p["tail"] for p in parts], lat, parts[0]["tail"]["tail_ms"],
                         parts[0].get("daemon_gc")) if parts else None
    per_batch = max(batches, 1)
    return {"workload": workload, "ids_per_request": k, "callers": callers,
            "load_procs": len(parts), "ok": ok, "errors": {str(s): n for s, n in status.items()},
            "seeds_per_s": ok * k / seconds, "req_per_s": ok / seconds, **latency_ms(lat),
            "load_cpu_frac": [round(p["cpu_frac"], 3) for p in parts],
            "engine_batches": batches, "routes": dict(routes),
            "sent_per_engine": np.sum([p["sent_per_engine"] for p in parts], axis=0).tolist(),
            "answered_per_engine": np.sum([p["answered_per_engine"] for p in parts],
                                          axis=0).tolist(),
            "load_ids_per_engine": np.sum([p["load_per_engine"] for p in parts], axis=0).tolist(),
            "mean_batch_seeds": sum(p["seeds"] for p in parts) / per_batch if batches else None,
            "mean_sampled_nodes": sum(p["sampled"] for p in parts) / per_batch,
            "mean_sample_ms": 1e3 * sum(p["sample_s"] for p in parts) / per_batch,
            "mean_compute_ms": 1e3 * sum(p["compute_s"] for p in parts) / per_batch,
            # sanity check: model time per second per engine core (about 1.0 at most)
            "engine_busy": sum(p["compute_s"] for p in parts) / seconds / engines,
            "tail": tail}
