"""The daemon benches' load (``bench.engine.pipeline``, ``bench.routing.routing_daemon``): the
load processes of ``loadtest/driver.py`` on the queue API, with an engine-side probe.

P spawned processes (kept for the whole run), each closed-loop asyncio callers of the queue
API's fast-path client (``connect_async``, driven by the point's own event loop, plain asyncio as
these benches always measured), started at one wall-clock instant; after a warm-up only requests
that complete inside the common window count. The probe (:class:`EngineProbe`, the driver's
probe hook) adds, per process: the batches the engine formed (from the stats-bearing replies, via
a ``PipelineObserver``), the requests each engine core got, and its part of the tail trace
(``loadtest/tail_trace.py``). The parent adds the daemon processes' collections during the
point and merges the parts into one row (:func:`merge_point`).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np

from loadtest.driver import LoadPool as DriverPool
from loadtest.stats import percentiles_ms
from loadtest.tail_trace import (
    TripLog,
    daemon_gc_diff,
    daemon_gc_snapshot,
    loop_lag,
    merge_reports,
    process_report,
)
from quiver_serve.metrics.observer import PipelineObserver

PROBE = "loadtest.engine_probe:EngineProbe"
OK = "200"


class BatchCounter(PipelineObserver):
    """Sums the per-batch stats that reach this client (one stats-bearing reply per batch)."""

    def __init__(self) -> None:
        self.batches = self.seeds = self.sampled = 0
        self.compute_s = self.sample_s = 0.0
        self.routes: Counter = Counter()
        self.log = TripLog()  # the tail trace (loadtest/tail_trace.py)

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
        return np.array([self.batches, self.seeds, self.sampled, self.compute_s,
                         self.sample_s]), Counter(self.routes)


class EngineProbe:
    """The driver's probe in a load process: engine batch stats and the tail trace of a point."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.obs = BatchCounter()
        self.snaps: list[tuple[np.ndarray, Counter]] = []
        self.lags_ms: list[float] = []
        self.pauses: list[tuple[int, float]] = []

    def observer(self) -> BatchCounter:
        return self.obs

    async def window(self, win0: float, win1: float) -> None:
        """Snapshots at both ends of the window; the trip log and the loop-lag ticker inside."""
        import asyncio

        self.snaps, self.lags_ms, self.pauses = [], [], []
        await asyncio.sleep(max(0.0, win0 - time.time()))
        self.snaps.append(self.obs.snapshot())
        self.obs.log.start()
        await loop_lag(win1, self.lags_ms)
        await asyncio.sleep(max(0.0, win1 - time.time()))
        self.pauses.extend(self.obs.log.stop())
        self.snaps.append(self.obs.snapshot())

    def report(self, caller: Any, lat_s: np.ndarray, options: dict) -> dict:
        d = self.snaps[1][0] - self.snaps[0][0]
        client = caller.client
        return {"tail": process_report(self.obs.log, lat_s, self.lags_ms, self.pauses,
                                       options.get("tail_ms", 20.0)),
                "batches": int(d[0]), "seeds": int(d[1]), "sampled": int(d[2]),
                "compute_s": float(d[3]), "sample_s": float(d[4]),
                "routes": self.snaps[1][1] - self.snaps[0][1],
                "sent_per_engine": list(client.sent), "answered_per_engine": list(client.answered),
                "load_per_engine": client.rows_in_flight}


class DaemonLoad:
    """The driver's load processes on the queue API of one daemon, with the engine probe;
    ``run`` measures one closed-loop point."""

    def __init__(self, endpoints: Any, procs: int, hot: np.ndarray, num_nodes: int) -> None:
        self.endpoints, self.hot, self.num_nodes = endpoints, hot, num_nodes
        self.pool = DriverPool(procs, start_timeout_s=300.0)

    def run(self, workload: str, k: int, callers: int, warm_s: float, seconds: float,
            timeout_s: float, tail_ms: float = 20.0) -> list[dict]:
        """One point; each part carries its probe report, and ``daemon_gc``: the daemon
        processes' collections during the point (loadtest/tail_trace.py)."""
        cmd = {"target": {"protocol": "queue", "endpoints": self.endpoints, "timeout_s": timeout_s},
               "spec": {"workload": workload, "ids_per_request": k, "num_nodes": self.num_nodes,
                        "hot": self.hot, "seed": 1000 * callers},
               "mode": "closed", "callers": callers, "rate": None, "warm_s": warm_s,
               "seconds": seconds, "max_inflight": max(1, callers), "arrivals": "poisson",
               "seed": 0, "uvloop": False, "probe": {"factory": PROBE, "tail_ms": tail_ms}}
        gc_before = daemon_gc_snapshot()
        parts = self.pool.run(cmd)
        time.sleep(0.1)  # the engine cores flush their pauses every 50 ms
        gc_diff = daemon_gc_diff(gc_before, daemon_gc_snapshot(), tail_ms)
        for part in parts:
            part["daemon_gc"] = gc_diff
        return parts

    def close(self) -> None:
        self.pool.close()


def merge_point(parts: list[dict], workload: str, k: int, callers: int, seconds: float,
                engines: int) -> dict:
    """One daemon point from its load processes' reports."""
    lat = np.concatenate([p["lat_s"] for p in parts]) if parts else np.zeros(0)
    probes = [p["probe"] for p in parts]
    status: Counter = Counter()
    routes: Counter = Counter()
    for p in parts:
        status.update(p["status"])
    for pr in probes:
        routes.update(pr["routes"])
    ok = status.pop(OK, 0)
    batches = sum(pr["batches"] for pr in probes)
    tail = merge_reports([pr["tail"] for pr in probes], lat, probes[0]["tail"]["tail_ms"],
                         parts[0].get("daemon_gc")) if parts else None
    per_batch = max(batches, 1)

    def per_engine(key: str) -> list:
        return np.sum([pr[key] for pr in probes], axis=0).tolist()

    return {"workload": workload, "ids_per_request": k, "callers": callers,
            "load_procs": len(parts), "ok": ok, "errors": {str(s): n for s, n in status.items()},
            "seeds_per_s": ok * k / seconds, "req_per_s": ok / seconds, **percentiles_ms(lat),
            "load_cpu_frac": [round(p["cpu_frac"], 3) for p in parts],
            "engine_batches": batches, "routes": dict(routes),
            "sent_per_engine": per_engine("sent_per_engine"),
            "answered_per_engine": per_engine("answered_per_engine"),
            "load_ids_per_engine": per_engine("load_per_engine"),
            "mean_batch_seeds": sum(pr["seeds"] for pr in probes) / per_batch if batches else None,
            "mean_sampled_nodes": sum(pr["sampled"] for pr in probes) / per_batch,
            "mean_sample_ms": 1e3 * sum(pr["sample_s"] for pr in probes) / per_batch,
            "mean_compute_ms": 1e3 * sum(pr["compute_s"] for pr in probes) / per_batch,
            # sanity check: model time per second per engine core (about 1.0 at most)
            "engine_busy": sum(pr["compute_s"] for pr in probes) / seconds / engines,
            "tail": tail}
