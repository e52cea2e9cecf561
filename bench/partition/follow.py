#!/usr/bin/env python
"""What a replica pays to follow its partition's log (``scaleout/partitioned/live.py``, decision
0053): a replica reads the primary's log folder up to its end before every read it answers.

    python -m bench.partition.follow     # bench/results/partition_follow_<machine>_<date>.json

On one partition of a generated graph (partitioned in the bench, 2 parts): the primary's cost
per acknowledged update (written and synced, ``graph.fsync: always``); a follower's read-time
catch-up when nothing is new (one ``fstat``) and when ``k`` records are new; and how long after
the primary acknowledged a record a follower in another process polling every millisecond had
applied it (negative: seen before the acknowledgement, the sync not yet done).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadtest.results import result_path, run_meta
from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.partition.data import load_partition, partition_graph, save_partitions
from quiver_serve.scaleout.partitioned.live import PartitionLive
from quiver_serve.scaleout.partitioned.sampling import as_tensor

NODES, DEGREE, FEATURES = 20_000, 10, 64


def graph(seed: int = 0) -> GraphData:
    rng = np.random.default_rng(seed)
    dst = np.sort(rng.integers(0, NODES, NODES * DEGREE))
    indptr = np.zeros(NODES + 1, np.int64)
    np.add.at(indptr, dst + 1, 1)
    x = torch.from_numpy(rng.standard_normal((NODES, FEATURES)).astype(np.float32))
    return GraphData("follow", torch.from_numpy(np.cumsum(indptr)),
                     torch.from_numpy(rng.integers(0, NODES, dst.size)), x)


def open_live(data_dir: Path, log: Path, follow: bool) -> PartitionLive:
    data = load_partition(data_dir, 0)
    return PartitionLive(log, GraphConfig(fsync="always"), 0, data.book, as_tensor(data.indptr),
                         as_tensor(data.indices), FEATURES, follow=follow)


def _poller(data_dir: str, log: str, last: int, out: Any) -> None:
    live = open_live(Path(data_dir), Path(log), follow=True)
    out.put("ready")
    seen: dict[int, float] = {}
    while live.version < last:
        before = live.version
        if live.catch_up():
            now = time.time()
            seen.update({v: now for v in range(before + 1, live.version + 1)})
        time.sleep(0.001)
    out.put(seen)


def quantiles_us(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1e6
    return {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "n": len(values)}


def run(data_dir: Path, log: Path, updates: int) -> dict[str, Any]:
    primary = open_live(data_dir, log, follow=False)
    mine = load_partition(data_dir, 0).global_ids
    rng = np.random.default_rng(1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    poller = ctx.Process(target=_poller, args=(str(data_dir), str(log), updates, out))
    poller.start()
    assert out.get(timeout=120) == "ready"  # the poller imported torch, opened its follower
    acked: dict[int, float] = {}
    write_s = []
    for _ in range(updates):
        pairs = [[int(rng.integers(0, NODES)), int(rng.choice(mine))]]
        t0 = time.perf_counter()
        v = primary.add_edges(pairs, [])["version"]
        write_s.append(time.perf_counter() - t0)
        acked[v] = time.time()
        time.sleep(0.002)
    seen = out.get(timeout=60)
    poller.join(10)
    lag = [seen[v] - acked[v] for v in acked]
    follower = open_live(data_dir, log, follow=True)
    idle = []
    for _ in range(2000):
        t0 = time.perf_counter()
        follower.catch_up()
        idle.append(time.perf_counter() - t0)
    batches: dict[str, Any] = {}
    for k in (1, 16, 256):
        for _ in range(k):
            primary.add_edges([[int(rng.integers(0, NODES)), int(rng.choice(mine))]], [])
        t0 = time.perf_counter()
        assert follower.catch_up() == k
        batches[str(k)] = (time.perf_counter() - t0) * 1e6 / k
    primary.close()
    follower.close()
    return {"primary_update": quantiles_us(write_s), "follower_idle_catch_up": quantiles_us(idle),
            "follower_apply_us_per_record": batches,
            "visible_after_ack_1ms_poller": quantiles_us(lag)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", help="folder of the JSON (default $OUT, else bench/results/)")
    ap.add_argument("--out", help="the JSON file (default: in --out-dir, by name)")
    ap.add_argument("--updates", type=int, default=300, help="timed updates of one edge")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="quiver-follow-"))
    book, datas, stats = partition_graph(graph(), 2, "hash")
    save_partitions(tmp / "parts", book, datas, stats, "follow")
    result = {"nodes": NODES, "edges": NODES * DEGREE,
              **run(tmp / "parts", tmp / "log", args.updates)}
    path = result_path("partition_follow", args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": run_meta(args), **result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
