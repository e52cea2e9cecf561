#!/usr/bin/env python
"""Garbage-collector pauses in the daemon's processes, with the start-up heap frozen and not.

For each ``server.gc_freeze`` value (true, false, alternating for ``--rounds``), starts the daemon
(``Pipeline``: engine cores and CPU samplers in their own processes), drives closed-loop load from
``--callers`` coroutines of ``--ids`` ids each (``Pipeline.embed_async``) for ``--seconds``, and
reports the callers' latency (p50 / p99 / p99.9 / max) beside every collection the daemon's
processes timed (``quiver_serve_gc_pause_seconds``: count, total and the largest bucket, by role
and generation). This process is the load generator; its own heap is frozen in both modes so its
collections do not land in the measurement.

Usage (from the repository root):
    python -m bench.engine.gc_pauses [--config quiver_serve/defaults/default.yaml] [--callers 32]
        [--ids 48] [--seconds 20] [--rounds 1] [--out FILE] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from loadtest.results import add_set_option, load_config, run_meta, write_result
from quiver_serve.engine.procs.heap import freeze_startup_heap


async def drive(p: Any, callers: int, ids: int, seconds: float, num_nodes: int) -> list[float]:
    """Closed loop: each caller sends its next request when the last one is answered."""
    latencies_s: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while time.perf_counter() < stop_at:
            batch = rng.integers(0, num_nodes, ids)
            t0 = time.perf_counter()
            await p.embed_async(batch)
            latencies_s.append(time.perf_counter() - t0)

    await asyncio.gather(*(caller(i) for i in range(callers)))
    return latencies_s


def gc_pauses(metrics_dir: str) -> dict[str, dict[str, float]]:
    """count / total / largest bucket bound of every (role, generation) seen, from the files."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=metrics_dir)
    out: dict[str, dict[str, float]] = {}
    for family in reg.collect():
        if family.name != "quiver_serve_gc_pause_seconds":
            continue
        for s in family.samples:
            key = f"{s.labels['role']} gen{s.labels['generation']}"
            row = out.setdefault(key, {"count": 0.0, "total_s": 0.0, "max_le_s": 0.0})
            if s.name.endswith("_count"):
                row["count"] += s.value
            elif s.name.endswith("_sum"):
                row["total_s"] += s.value
            elif s.name.endswith("_bucket") and s.value > 0:
                le = float(s.labels["le"])
                below = [b.value for b in family.samples if b.name == s.name and b.labels.get(
                    "role") == s.labels["role"] and b.labels.get("generation") == s.labels[
                    "generation"] and b.labels.get("le") not in ("+Inf",) and float(
                    b.labels["le"]) < le]
                if s.value > max(below, default=0.0):  # a pause in this bucket
                    row["max_le_s"] = max(row["max_le_s"], le)
    return {k: v for k, v in sorted(out.items()) if v["count"]}


def one_run(cfg: Any, freeze: bool, args: argparse.Namespace) -> dict[str, Any]:
    from quiver_serve.engine.client.pipeline import Pipeline

    metrics_dir = tempfile.mkdtemp(prefix="quiver-gc-bench-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    cfg.server.gc_freeze = freeze
    p = Pipeline(cfg).start()
    try:
        asyncio.run(drive(p, args.callers, args.ids, args.warmup, p.num_nodes))
        lat = np.array(asyncio.run(drive(p, args.callers, args.ids, args.seconds, p.num_nodes)))
    finally:
        p.stop()
    pauses = gc_pauses(metrics_dir)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    q = np.percentile(lat, [50, 99, 99.9]) * 1e3
    return {"gc_freeze": freeze, "requests": int(lat.size),
            "seeds_per_s": float(lat.size * args.ids / args.seconds),
            "p50_ms": float(q[0]), "p99_ms": float(q[1]), "p999_ms": float(q[2]),
            "max_ms": float(lat.max() * 1e3), "gc": pauses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="quiver_serve/defaults/default.yaml")
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--ids", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=1, help="on/off pairs, alternating")
    ap.add_argument("--out", help="JSON file")
    add_set_option(ap)
    args = ap.parse_args()
    freeze_startup_heap("load generator")
    runs = []
    for _ in range(args.rounds):
        for freeze in (False, True):
            r = one_run(load_config(args.config, args.sets), freeze, args)
            runs.append(r)
            gen2 = {k: v for k, v in r["gc"].items() if k.endswith("gen2")}
            print(f"gc_freeze={str(freeze).lower():5} {r['seeds_per_s']:>10,.0f} seeds/s  p50 "
                  f"{r['p50_ms']:.2f}  p99 {r['p99_ms']:.2f}  p99.9 {r['p999_ms']:.2f}  max "
                  f"{r['max_ms']:.1f} ms  full collections: " + (", ".join(
                      f"{k[:-5]} {v['count']:.0f} ({v['total_s'] * 1e3:.0f} ms, max <= "
                      f"{v['max_le_s'] * 1e3:g} ms)" for k, v in gen2.items()) or "none"),
                  flush=True)
    if args.out:
        write_result(args.out, {"meta": run_meta(args), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
