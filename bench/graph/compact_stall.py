"""What a compaction costs the writer's update calls, in one process (decision 0057).

A random graph (--nodes, --edges, --features) behind a ``GraphWriter`` on a temporary log;
--prefill calls of --edges-per-call edges fill the overlay; then one thread posts a call every
--gap-ms and a heartbeat thread sleeps 1 ms at a time, for a quiet second, through ``compact()``
and the writer's move to the new base (``maybe_rebase``), and a second after; a second process
sleeps 1 ms at a time throughout (what a front-end on the same machine gets of its cores). Reports
update-call and heartbeat-oversleep p50 / p99 / max (both heartbeats), quiet against during the
compaction, and the phases.

    python -m bench.graph.compact_stall --nodes 233000 --edges 100000000 --features 602
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from loadtest import results
from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import GraphWriter


def summary(samples: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    ms = np.asarray([v for s, v in samples if lo <= s <= hi]) * 1e3
    if not ms.size:
        return {"count": 0}
    return {"count": int(ms.size), "p50_ms": float(np.median(ms)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def probe(conn: Connection) -> None:
    """Another process's heartbeat (a front-end's share of the machine): sleep 1 ms at a time
    until told to stop; send back (wall time, oversleep seconds) of each."""
    conn.send("ready")
    beats = []
    while not conn.poll():
        t0, wall = time.perf_counter(), time.time()
        time.sleep(0.001)
        beats.append((wall, time.perf_counter() - t0 - 0.001))
    conn.recv()
    conn.send(beats)


def run(args: argparse.Namespace, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    ei = torch.from_numpy(rng.integers(0, args.nodes, (2, args.edges)))
    base = GraphData.from_edge_index(ei, torch.randn(args.nodes, args.features), "bench")
    del ei
    log = UpdateLog(folder)
    log.open()
    writer = GraphWriter(GraphConfig(overlay_capacity_edges=1 << 26, fsync=args.fsync,
                                     compact_threads=args.compact_threads), base, 0, log)
    none = np.empty((0, 2), np.int64)

    def call() -> float:
        t0 = time.perf_counter()
        writer.add_edges(rng.integers(0, args.nodes, (args.edges_per_call, 2)), none)
        return time.perf_counter() - t0

    for _ in range(args.prefill):
        call()
    calls: list[tuple[float, float]] = []
    beats: list[tuple[float, float]] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            calls.append((time.perf_counter(), call()))
            time.sleep(args.gap_ms / 1e3)

    def heart() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            beats.append((t0, time.perf_counter() - t0 - 0.001))

    threads = [threading.Thread(target=caller), threading.Thread(target=heart)]
    for t in threads:
        t.start()
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    other = spawn.Process(target=probe, args=(theirs,), daemon=True)
    other.start()
    assert ours.poll(120) and ours.recv() == "ready"
    time.sleep(1.0)
    c0, w0 = time.perf_counter(), time.time()
    result = writer.compact()
    c1 = time.perf_counter()
    rebased = writer.maybe_rebase()
    c2, w2 = time.perf_counter(), time.time()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    ours.send("stop")
    far = ours.recv() if ours.poll(60) else []
    other.join(10)
    return {"compaction": result, "compact_s": c1 - c0, "rebase_s": c2 - c1, "rebased": rebased,
            "update_quiet": summary(calls, 0, c0 - 0.05),
            "update_compacting": summary(calls, c0, c2),
            "heartbeat_quiet": summary(beats, 0, c0 - 0.05),
            "heartbeat_compacting": summary(beats, c0, c2),
            "other_process_quiet": summary(far, 0, w0 - 0.05),
            "other_process_compacting": summary(far, w0, w2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=233_000)
    ap.add_argument("--edges", type=int, default=20_000_000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--edges-per-call", type=int, default=2000)
    ap.add_argument("--prefill", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--fsync", default="group")
    ap.add_argument("--compact-threads", type=int, default=1,
                    help="graph.compact_threads (torch's default: every core)")
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = run(args, Path(d))
        print(json.dumps(results.jsonable(result), indent=1))
        if args.out is not None:
            results.write_result(args.out, {"meta": results.run_meta(args, **vars(args)),
                                            "result": result}, d)


if __name__ == "__main__":
    main()
