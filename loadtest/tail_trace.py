"""Where the slowest requests of a daemon point spent their time (``bench.engine.pipeline
--tail-ms``).

The H200 runs showed 100-190 ms p99.9 outliers at 64-384 callers on every path (queue API
included) while p99 stayed at 6-9 ms. A request's latency seen by a load process is the sum of

* ``client_out``: the caller's submit to the client sending its micro-batch, plus
  ``client_in``: the reply read to the caller running again (both inside the load process);
* ``to_engine``: sent to taken in by the engine core (``time.time()``: one clock per machine);
* ``engine``: taken in to reply built (queue, sampling, gather + model, reply);
* ``back``: reply built to read by the client.

Each load process logs every micro-batch's round trip (``PipelineObserver.on_round_trip``), the
split of each batch's first micro-batch (the one carrying the batch's stats: ``on_transport``),
the engine's per-batch stats (``on_batch``), its own event loop's lag (a 1 ms ticker) and its own
garbage collections (``GcPauses``); the bench process reads the daemon processes' collections from the
``quiver_serve_gc_pause_seconds`` histogram before and after the point. A slow trip is put down to
its largest part; slow requests beyond the slow round trips are the load process's own (client
side: its event loop, its collections, the CPU it gets).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import numpy as np

from quiver_serve.engine.procs.heap import GcPauses

#: trips kept per load process and point (a point at 2 M seeds/s logs ~40 k micro-batches/s)
MAX_TRIPS = 1 << 20
#: slowest trips reported per point
WORST_KEPT = 12
TRIP_PARTS = ("to_engine", "engine", "back")


class TripLog:
    """Micro-batch trips and batch stats of one load process, recorded while ``on``."""

    def __init__(self) -> None:
        self.trips = np.zeros((MAX_TRIPS, 4))  # sent, engine in, engine out, received (time.time)
        self.n = 0
        self.round_trips_ms = np.zeros(MAX_TRIPS)  # every micro-batch, stats or not
        self.n_round = 0
        self.on = False
        self.batch_max_s: Counter = Counter()  # largest queue / sample / compute of a batch seen
        #: per route, the batch that sampled longest: (sample s, predicted s, seeds, psgs)
        self.slowest_by_route: dict[str, tuple[float, float, int, float]] = {}
        self.gc = GcPauses()

    def start(self) -> None:
        self.n = self.n_round = 0
        self.batch_max_s = Counter()
        self.slowest_by_route = {}
        self.gc.install()
        self.gc.flush(lambda g, s: None)  # drop what came before the window
        self.on = True

    def stop(self) -> list[tuple[int, float]]:
        """Ends the window; returns this process's collections in it, (generation, seconds)."""
        self.on = False
        pauses: list[tuple[int, float]] = []
        self.gc.flush(lambda g, s: pauses.append((g, s)))
        self.gc.close()
        return pauses

    def add_trip(self, sent_s: float, engine_in_s: float, engine_out_s: float,
                 received_s: float) -> None:
        if self.on and self.n < MAX_TRIPS and engine_in_s > 0:
            self.trips[self.n] = (sent_s, engine_in_s, engine_out_s, received_s)
            self.n += 1

    def add_round_trip(self, sent_s: float, received_s: float) -> None:
        if self.on and self.n_round < MAX_TRIPS:
            self.round_trips_ms[self.n_round] = (received_s - sent_s) * 1e3
            self.n_round += 1

    def add_batch(self, stats: Any) -> None:
        if self.on:
            worst = self.slowest_by_route.get(stats.route)
            if worst is None or stats.sample_s > worst[0]:
                self.slowest_by_route[stats.route] = (float(stats.sample_s),
                                                      float(stats.predicted_s),
                                                      int(stats.num_seeds), float(stats.psgs))
            for part in ("queue_s", "sample_s", "compute_s"):
                v = float(getattr(stats, part))
                if v > self.batch_max_s[part]:
                    self.batch_max_s[part] = v


async def loop_lag(until_s: float, lags_ms: list[float], tick_s: float = 0.001) -> None:
    """This event loop's lag beyond each ``tick_s`` sleep, kept when over 2 ms."""
    while time.time() < until_s:
        t0 = time.perf_counter()
        await asyncio.sleep(tick_s)
        lag_ms = (time.perf_counter() - t0 - tick_s) * 1e3
        if lag_ms > 2.0:
            lags_ms.append(lag_ms)


def process_report(log: TripLog, lat_s: np.ndarray, lags_ms: list[float],
                   pauses: list[tuple[int, float]], tail_ms: float) -> dict:
    """One load process's part of the tail: counts over ``tail_ms`` and its slowest trips."""
    trips = log.trips[:log.n]
    total_ms = (trips[:, 3] - trips[:, 0]) * 1e3
    parts_ms = np.diff(trips, axis=1) * 1e3  # to_engine, engine, back
    slow = np.flatnonzero(total_ms > tail_ms)
    worst = slow[np.argsort(total_ms[slow])[::-1][:WORST_KEPT]]
    return {
        "tail_ms": tail_ms, "requests": int(lat_s.size), "slow_requests": int((lat_s * 1e3 > tail_ms).sum()),
        "trips": int(log.n), "slow_trips": int(slow.size),
        "round_trips": int(log.n_round),
        "slow_round_trips": int((log.round_trips_ms[:log.n_round] > tail_ms).sum()),
        "slow_trips_by_part": dict(Counter(TRIP_PARTS[int(i)] for i in
                                           parts_ms[slow].argmax(axis=1)) if slow.size else {}),
        "worst_trips": [{"total_ms": float(total_ms[i]), "sent_s": float(trips[i, 0]),
                         **{p: float(parts_ms[i, j]) for j, p in enumerate(TRIP_PARTS)}}
                        for i in worst],
        "trip_ms": _quantiles(total_ms),
        "loop_lag_over_tail": int(sum(1 for x in lags_ms if x > tail_ms)),
        "loop_lag_max_ms": max(lags_ms, default=0.0),
        "gc_pauses": len(pauses), "gc_max_ms": 1e3 * max((s for _, s in pauses), default=0.0),
        "gc_full": sum(1 for g, _ in pauses if g == 2),
        "batch_max_ms": {k: 1e3 * v for k, v in log.batch_max_s.items()},
        "slowest_sample_by_route": {
            r: {"sample_ms": 1e3 * v[0], "predicted_ms": 1e3 * v[1], "seeds": v[2], "psgs": v[3]}
            for r, v in log.slowest_by_route.items()},
    }


def _quantiles(x_ms: np.ndarray) -> dict:
    if x_ms.size == 0:
        return {}
    q = np.percentile(x_ms, [50, 99, 99.9])
    return {"p50": float(q[0]), "p99": float(q[1]), "p999": float(q[2]), "max": float(x_ms.max())}


def merge_reports(parts: list[dict], lat_s: np.ndarray, tail_ms: float,
                  daemon_gc: dict | None) -> dict:
    """The point's tail from its load processes' reports (and the daemon's collections)."""
    by_part: Counter = Counter()
    for p in parts:
        by_part.update(p["slow_trips_by_part"])
    worst = sorted((t for p in parts for t in p["worst_trips"]),
                   key=lambda t: -t["total_ms"])[:WORST_KEPT]
    lat_ms = lat_s * 1e3
    return {
        "tail_ms": tail_ms, "request_ms": _quantiles(lat_ms),
        "slow_requests": int((lat_ms > tail_ms).sum()),
        "slow_trips": sum(p["slow_trips"] for p in parts), "slow_trips_by_part": dict(by_part),
        "trips": sum(p["trips"] for p in parts),
        "round_trips": sum(p["round_trips"] for p in parts),
        "slow_round_trips": sum(p["slow_round_trips"] for p in parts),
        "trip_p999_ms_per_process": [p["trip_ms"].get("p999") for p in parts],
        "load_loop_lag_over_tail": sum(p["loop_lag_over_tail"] for p in parts),
        "load_loop_lag_max_ms": max((p["loop_lag_max_ms"] for p in parts), default=0.0),
        "load_gc_pauses": sum(p["gc_pauses"] for p in parts),
        "load_gc_full": sum(p["gc_full"] for p in parts),
        "load_gc_max_ms": max((p["gc_max_ms"] for p in parts), default=0.0),
        "batch_max_ms": {k: max(p["batch_max_ms"].get(k, 0.0) for p in parts)
                         for k in ("queue_s", "sample_s", "compute_s")},
        "daemon_gc": daemon_gc or {},
        "slowest_sample_by_route": _slowest(parts),
        "worst_trips": worst,
    }


def _slowest(parts: list[dict]) -> dict:
    """Per route, the batch that sampled longest in any load process's view."""
    out: dict = {}
    for p in parts:
        for route, b in p["slowest_sample_by_route"].items():
            if route not in out or b["sample_ms"] > out[route]["sample_ms"]:
                out[route] = b
    return out


def daemon_gc_snapshot() -> dict[tuple[str, str], np.ndarray]:
    """Per (role, generation): cumulative bucket counts of ``quiver_serve_gc_pause_seconds``
    over every daemon process (read from the multiprocess directory), ``le`` ascending."""
    import os

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from quiver_serve.metrics.prometheus import ENV, PREFIX

    path = os.environ.get(ENV)
    if not path or not os.path.isdir(path):
        return {}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    for family in registry.collect():
        if family.name != PREFIX + "gc_pause_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = (s.labels["role"], s.labels["generation"])
                buckets.setdefault(key, {})[float(s.labels["le"])] = s.value
    return {k: np.array([v[le] for le in sorted(v)]) for k, v in buckets.items()}


def daemon_gc_diff(before: dict, after: dict, tail_ms: float) -> dict:
    """Collections in the daemon's processes between two snapshots: per role and generation,
    how many, and how many took longer than the bucket at or above ``tail_ms``."""
    from quiver_serve.metrics.prometheus import GC_PAUSE_BUCKETS_S

    les = [*GC_PAUSE_BUCKETS_S, float("inf")]
    over = next(i for i, le in enumerate(les) if le * 1e3 >= tail_ms)
    out = {}
    for key, cum in after.items():
        d = cum - before.get(key, np.zeros_like(cum))
        if d[-1] > 0:
            out[f"{key[0]} gen{key[1]}"] = {"pauses": int(d[-1]),
                                            "over_tail": int(d[-1] - d[over])}
    return out


def print_tail(t: dict) -> None:
    """One line per point: where the requests slower than ``tail_ms`` went."""
    rq = t["request_ms"]
    gc_slow = {k: v["over_tail"] for k, v in t["daemon_gc"].items() if v["over_tail"]}
    print(f"   tail > {t['tail_ms']:g} ms: {t['slow_requests']} requests (p99.9 "
          f"{rq.get('p999', 0):.1f}, max {rq.get('max', 0):.1f} ms); micro-batch round trips "
          f"{t['slow_round_trips']} of {t['round_trips']}; batches' first trips "
          f"{t['slow_trips']} of {t['trips']} {t['slow_trips_by_part']}; load loops lagged "
          f"{t['load_loop_lag_over_tail']}x (max {t['load_loop_lag_max_ms']:.1f} ms), load GC "
          f"{t['load_gc_pauses']} ({t['load_gc_full']} full, max {t['load_gc_max_ms']:.1f} ms); "
          f"daemon GC over tail {gc_slow or 0}; batch max ms "
          f"{ {k: round(v, 1) for k, v in t['batch_max_ms'].items()} }", flush=True)
    for route, b in t["slowest_sample_by_route"].items():
        if b["sample_ms"] > t["tail_ms"] / 2:
            print(f"     slowest {route} sample {b['sample_ms']:.1f} ms (predicted batch "
                  f"{b['predicted_ms']:.1f} ms; {b['seeds']} seeds, PSGS {b['psgs']:,.0f})",
                  flush=True)
    for w in t["worst_trips"][:3]:
        print(f"     worst trip {w['total_ms']:.1f} ms: to_engine {w['to_engine']:.1f} engine "
              f"{w['engine']:.1f} back {w['back']:.1f}", flush=True)
