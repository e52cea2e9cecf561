#!/usr/bin/env python
"""Where one small request's time goes through the queue API, stage by stage.

Starts the daemon (``Pipeline``: its engine core and CPU samplers are their own processes), then
one caller in this process sends requests of ``--ids`` ids one after another, synchronously
(``Pipeline.embed``) or from an asyncio loop (``Pipeline.embed_async``), and splits each
request's time with the timestamps the serving path already carries (``time.time()``, one clock
for every process of the machine):

* ``submit``: caller's call to the client's IO thread sending the micro-batch;
* ``to_engine``: sent to taken in by the engine core (ZeroMQ IPC and the engine loop's wake);
* ``queue``: taken in to batch formed; ``sample``: sampling; ``compute``: gather + model (GPU:
  device time of the batch's stream); ``engine_other``: the rest of the engine's time on it
  (routing, launching, waiting for the copy-out, building the reply);
* ``to_client``: reply built to read by the client's IO thread;
* ``wake``: reply read to the caller running again (future, thread or event-loop hand-off).

Usage (from the repository root):
    python -m bench.engine.trace_latency [--config quiver_serve/defaults/default.yaml] [--route auto]
        [--ids 1] [--requests 3000] [--mode sync|async] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from loadtest.results import add_set_option, load_config, run_meta, write_result
from quiver_serve.metrics.observer import PipelineObserver

STAGES = ("submit", "to_engine", "queue", "sample", "compute", "engine_other", "to_client", "wake")


class TraceObserver(PipelineObserver):
    """Keeps the last micro-batch's stats and trip (one caller: one micro-batch per request)."""

    def __init__(self) -> None:
        self.stats: Any = None
        self.trip: tuple[float, float, float, float] | None = None

    def on_batch(self, stats: Any) -> None:
        self.stats = stats

    def on_transport(self, sent_s: float, engine_received_s: float, engine_replied_s: float,
                     received_s: float) -> None:
        self.trip = (sent_s, engine_received_s, engine_replied_s, received_s)


def split(t0: float, t1: float, obs: TraceObserver) -> dict[str, float] | None:
    """One request's stages in seconds (None when its reply carried no stats)."""
    if obs.trip is None or obs.stats is None:
        return None
    sent, got, replied, back = obs.trip
    st = obs.stats
    engine_s = replied - got
    return {"total": t1 - t0, "submit": sent - t0, "to_engine": got - sent, "queue": st.queue_s,
            "sample": st.sample_s, "compute": st.compute_s,
            "engine_other": engine_s - st.queue_s - st.sample_s - st.compute_s,
            "to_client": back - replied, "wake": t1 - back, "route": st.route}


def run_sync(p: Any, reqs: np.ndarray, obs: TraceObserver, warm: int) -> list[dict]:
    rows = []
    for j, ids in enumerate(reqs):
        obs.trip = obs.stats = None
        t0 = time.time()
        p.embed(ids)
        row = split(t0, time.time(), obs)
        if j >= warm and row is not None:
            rows.append(row)
    return rows


async def run_async(p: Any, reqs: np.ndarray, obs: TraceObserver, warm: int) -> list[dict]:
    rows = []
    for j, ids in enumerate(reqs):
        obs.trip = obs.stats = None
        t0 = time.time()
        await p.embed_async(ids)
        row = split(t0, time.time(), obs)
        if j >= warm and row is not None:
            rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows), "routes": {}}
    for r in rows:
        out["routes"][r["route"]] = out["routes"].get(r["route"], 0) + 1
    for key in ("total", *STAGES):
        v = np.asarray([r[key] for r in rows]) * 1e3
        out[key] = {"p50_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90)),
                    "mean_ms": float(v.mean())}
    return out


def print_table(res: dict[str, Any], title: str) -> None:
    print(f"\n{title}: {res['requests']} requests, routes {res['routes']}")
    print("| stage | p50 ms | p90 ms | mean ms |")
    print("|---|---|---|---|")
    for key in (*STAGES, "total"):
        s = res[key]
        print(f"| {key} | {s['p50_ms']:.3f} | {s['p90_ms']:.3f} | {s['mean_ms']:.3f} |")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="quiver_serve/defaults/default.yaml")
    ap.add_argument("--scale", type=float, help="override graph.synthetic_scale")
    ap.add_argument("--route", help="override sampling.route (auto, cpu, gpu, local, quiver)")
    ap.add_argument("--ids", type=int, default=1, help="ids per request")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300, help="requests not counted")
    ap.add_argument("--mode", choices=["sync", "async", "both"], default="both")
    ap.add_argument("--out", help="JSON file")
    add_set_option(ap)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from quiver_serve.engine.client.pipeline import Pipeline

    cfg = load_config(args.config, args.sets)
    if args.scale is not None:
        cfg.graph.synthetic_scale = args.scale
    if args.route is not None:
        cfg.sampling.route = args.route
    obs = TraceObserver()
    p = Pipeline(cfg, observer=obs).start()
    try:
        rng = np.random.default_rng(0)
        reqs = rng.integers(0, p.num_nodes, (args.requests + args.warmup, args.ids))
        out: dict[str, Any] = {"meta": run_meta(args, cfg), "route": cfg.sampling.route,
                               "ids": args.ids}
        if args.mode in ("sync", "both"):
            out["sync"] = summarise(run_sync(p, reqs, obs, args.warmup))
            print_table(out["sync"], "Pipeline.embed (sync caller)")
        if args.mode in ("async", "both"):
            out["async"] = summarise(asyncio.run(run_async(p, reqs, obs, args.warmup)))
            print_table(out["async"], "Pipeline.embed_async (asyncio caller)")
    finally:
        p.stop()
    if args.out:
        write_result(args.out, out)


if __name__ == "__main__":
    main()
