#!/usr/bin/env python
"""Compaction of a partition's log (docs/decisions/0063-partition-compaction.md) against a
partition whose log is never compacted, in one run:

1. a synthetic graph of --preset x --scale, partitioned in two (hash) into a temporary folder;
2. two primaries of partition 0 in this process, each over its own log folder (no Ray: updates
   and compaction call no peer): A compacts (``POST /v1/graph/compact``'s call after --warm-s,
   and by fill), B never (an overlay large enough for the whole stream). Both take the same
   edge updates (--batch pairs into partition 0's nodes, 10% removals) at --rate calls/s from
   one asyncio loop: per-call latency p50 / p99 / max of A before, during and after its
   compaction, and of B over the whole run; the compaction's seconds;
3. restart: a server started again over each folder, seconds to serve (A maps its base and
   replays the records after it; B replays every record), and the records each replayed.

    python -m bench.partition.compaction --scale 0.01 --out bench/results/partition_compaction_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.typed.serve_mag import percentiles_ms
from loadtest.results import run_meta, write_result
from quiver_serve.config import ServeConfig
from quiver_serve.graph.datasets import load_graph
from quiver_serve.partition.data import load_book, partition_graph, save_partitions
from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs


def config(preset: str, scale: float, log_dir: Path, capacity: int | None) -> ServeConfig:
    cfg = ServeConfig.default()
    g = cfg.graph
    g.format, g.synthetic_preset, g.synthetic_scale = "synthetic", preset, scale  # type: ignore[assignment]
    g.update_log_dir, g.overlay_capacity_edges = str(log_dir), capacity
    cfg.model.weights, cfg.inference.device = None, "cpu"  # type: ignore[assignment]
    return cfg


async def stream(servers: dict[str, PartitionServer], mine: np.ndarray, n: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The update stream into both servers; A compacted at --warm-s. Latency per window."""
    rng = np.random.default_rng(0)
    lat: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    t_start = time.perf_counter()
    compaction: asyncio.Future[Any] | None = None
    period_s = 1.0 / args.rate
    while (now := time.perf_counter() - t_start) < args.seconds:
        if compaction is None and now >= args.warm_s:
            compaction = asyncio.ensure_future(servers["A"].compact())
            began = now
        add = np.stack([rng.integers(0, n, args.batch), rng.choice(mine, args.batch)], 1)
        remove = add[: args.batch // 10] if rng.random() < 0.5 else add[:0]
        for name, server in servers.items():
            t0 = time.perf_counter()
            out = await server.update("edges", add.tolist(), remove.tolist())
            lat[name].append((now, time.perf_counter() - t0))
            assert "code" not in out or out["code"] == "overlay_full", out
        await asyncio.sleep(max(0.0, period_s - (time.perf_counter() - t_start - now)))
    assert compaction is not None
    answer = await compaction
    done = began + float(answer.get("duration_s", 0.0))
    windows = {"before": [s for t, s in lat["A"] if t < began],
               "during": [s for t, s in lat["A"] if began <= t < done],
               "after": [s for t, s in lat["A"] if t >= done]}
    out = {f"A_{k}": {**percentiles_ms(v), "max_ms": max(v, default=0) * 1e3, "calls": len(v)}
           for k, v in windows.items()}
    b = [s for _, s in lat["B"]]
    out["B_all"] = {**percentiles_ms(b), "max_ms": max(b) * 1e3, "calls": len(b)}
    out["compaction"] = answer
    out["compactions_A"] = servers["A"].moves.snapshot()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="papers100m")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warm-s", type=float, default=5.0)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = config(args.preset, args.scale, root / "logs-A", None)
        graph = load_graph(cfg.graph)
        data = root / "parts"
        save_partitions(data, *partition_graph(graph, 2, "hash"), graph.name)
        mine = load_book(data).global_ids(0)
        cfgs = {"A": cfg, "B": config(args.preset, args.scale, root / "logs-B", 1 << 23)}
        cfgs["B"].graph.compact_at_fill = 1.0
        dumped = {k: c.model_dump(mode="json") for k, c in cfgs.items()}

        def start(name: str) -> tuple[PartitionServer, float]:
            t0 = time.perf_counter()
            server = PartitionServer(dumped[name], ServerArgs("bench", str(data), 0, 0, 1))
            return server, time.perf_counter() - t0

        async def run() -> dict[str, Any]:
            servers = {k: start(k)[0] for k in cfgs}
            out = await stream(servers, mine, graph.num_nodes, args)
            for s in servers.values():
                s.close()
            return out

        result: dict[str, Any] = {"graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
                                  "stream": asyncio.run(run())}
        for name in cfgs:
            server, took_s = start(name)
            result[f"restart_{name}"] = {"seconds": round(took_s, 3),
                                         "replayed": server.live.replayed,
                                         "base_version": server.live.base_version,
                                         "version": server.live.version}
            server.close()
    print(result)
    if args.out:
        write_result(args.out, {"meta": run_meta(args, cfg, **vars(args)), "result": result})


if __name__ == "__main__":
    main()
