#!/usr/bin/env python
"""Where a partition server's time goes: two partition servers of a papers100M-shaped graph in one
process (no Ray; each reaches the other over the project's wire on 127.0.0.1), driven through
``PartitionServer.embed`` as the ingress drives them, each stage timed.

Stages (milliseconds per round of ``--concurrent`` requests, medians; one request per round for
the single-id and 48-id workloads): ``sample`` (every hop: the local draws, the remote calls'
wait, placing answers and the subgraph builder), ``gather`` (own rows, replicated hot rows,
remote rows), ``forward`` (the model and the copy of the answer), ``total`` (``embed``, summed
over the round's requests). The peer's own time answering a call is inside the caller's remote
wait; ``cpu_ms_per_request`` is the process's CPU time per request.

    python -m bench.partition.profile --scale 0.01 --out-dir OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.partition.profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.01, help="papers100M x this")
    ap.add_argument("--out-dir", required=True, help="partitions are kept here between runs")
    ap.add_argument("--requests", type=int, default=60, help="timed requests per workload")
    ap.add_argument("--concurrent", type=int, default=16,
                    help="requests in flight for the batched (load) workload")
    ap.add_argument("--hot-budget-mb", type=float, default=0.0,
                    help="replicated rows per partition (default: a fifth of the features)")
    ap.add_argument("--only", nargs="+", default=None,
                    help="workloads to run (single_id, b_48_ids, b_48_ids_load; default all)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--compare-set", dest="compare", action="append", default=[],
                    help="KEY=VALUE: a second pair of servers with this override too, driven "
                         "with the same requests, alternating with the first (A/B in one run)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --compare-set: A then B this many times per workload")
    return ap.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[Any, Path]:
    """The served config and the partition folder (made once per ``--out-dir``)."""
    from quiver_serve.config import ServeConfig
    from quiver_serve.graph.datasets import load_graph
    from quiver_serve.partition.data import partition_graph, save_partitions

    cfg = ServeConfig.default().with_overrides([
        "graph.format=synthetic", "graph.synthetic_preset=papers100m",
        f"graph.synthetic_scale={args.scale}", "model.weights=null", "exact.materialize=off",
        "inference.device=cpu", *args.sets])
    parts = Path(args.out_dir) / "parts"
    if not (parts / "book.npz").exists():
        t0 = time.perf_counter()
        graph = load_graph(cfg.graph)
        budget = args.hot_budget_mb * 1e6 or graph.x.numel() * 4 / 5
        book, data, stats = partition_graph(graph, 2, "ldg", hot_budget_bytes=int(budget),
                                            fap_fanouts=list(cfg.sampling.fanouts))
        save_partitions(parts, book, data, stats, graph.name)
        print(f"{graph.describe()}; partitioned in {time.perf_counter() - t0:.1f} s")
    return cfg, parts


class Clock:
    """Wall time per stage name, per request (``record`` wraps a function or coroutine)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.rows: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(fn):
            async def timed_async(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **kw)
                finally:
                    self.now[name] += time.perf_counter() - t0
            return timed_async

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[name] += time.perf_counter() - t0
        return timed

    def cut(self) -> None:
        self.rows.append(dict(self.now))
        self.now.clear()

    def medians_ms(self) -> dict[str, float]:
        names = sorted({k for r in self.rows for k in r})
        return {k: round(statistics.median(r.get(k, 0.0) for r in self.rows) * 1e3, 3)
                for k in names}


def servers(cfg: Any, parts: Path, clock: Clock) -> list[Any]:
    """Both partition servers, wired to each other, their stages timed by ``clock``."""
    import quiver_serve.scaleout.partitioned.sampling as sampling_mod
    from quiver_serve.scaleout.partitioned.links import WireLink
    from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs

    made = [PartitionServer(cfg.model_dump(mode="json"),
                            ServerArgs("prof", str(parts), p, 0, 1)) for p in range(2)]
    addresses = [s.wire.start("127.0.0.1") for s in made]

    async def address_of(part: int, replica: int) -> str:
        return addresses[part]

    for s in made:
        s.peers.link = WireLink(address_of)
    caller = made[0]
    caller.sampler.hop = clock.wrap("sample.hop_total", caller.sampler.hop)
    caller.peers.sample_hop = clock.wrap("sample.remote_wait", caller.peers.sample_hop)
    caller.sampler.remote = caller.peers.sample_hop
    if not getattr(sampling_mod.local_hop, "timed", False):  # once per process
        sampling_mod.local_hop = clock.wrap("sample.local_draws", sampling_mod.local_hop)
        sampling_mod.local_hop.timed = True
    caller.sampler.sample = clock.wrap("sample", caller.sampler.sample)
    caller.features.gather = clock.wrap("gather", caller.features.gather)
    caller.peers.rows = clock.wrap("gather.remote_wait", caller.peers.rows)
    caller.features.remote = caller.peers.rows
    caller.forward = clock.wrap("forward", caller.forward)
    return made


async def drive(server: Any, ids_of: Callable[[int], np.ndarray], requests: int,
                concurrent: int, clock: Clock, seeded: bool) -> dict[str, Any]:
    """``requests`` embeds, ``concurrent`` at a time; per-request stage medians, requests/s."""
    async def one(i: int) -> None:
        t0 = time.perf_counter()
        out = await server.embed(ids_of(i), False, i if seeded else None, 30.0)
        assert not isinstance(out, dict), out
        clock.now["total"] += time.perf_counter() - t0

    for i in range(3):  # warm-up: sockets, first model call
        await one(i)
    clock.now.clear()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, requests, concurrent):
        await asyncio.gather(*(one(i) for i in range(start, min(start + concurrent, requests))))
        clock.cut()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    # CPU time of the process (both servers, every thread) per request: steadier than the
    # wall-clock stages on a box shared with other work
    return {"requests_per_s": round(requests / wall, 1), "per_batch_ms": clock.medians_ms(),
            "cpu_ms_per_request": round(cpu / requests * 1e3, 3),
            "batches": server.batches.batches}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cfg, parts = build(args)
    clock = Clock()
    variants = {"a": servers(cfg, parts, clock)}
    if args.compare:
        logs_b = Path(args.out_dir) / "updates_b"  # each primary holds its log's lock
        variants["b"] = servers(cfg.with_overrides([*args.compare,
                                                    f"graph.update_log_dir={logs_b}"]),
                                parts, clock)
    caller = variants["a"][0]
    rng = np.random.default_rng(0)
    owned = np.flatnonzero(caller.graph.owner.numpy() == 0)
    out: dict[str, Any] = {"scale": args.scale, "nodes": caller.num_nodes, "sets": args.sets,
                           "compare_set": args.compare}
    for name, size, concurrent, seeded in (("single_id", 1, 1, True), ("b_48_ids", 48, 1, True),
                                           ("b_48_ids_load", 48, args.concurrent, False)):
        if args.only and name not in args.only:
            continue
        ids = [rng.choice(owned, size) for _ in range(args.requests + 3)]
        for _ in range(args.rounds if args.compare else 1):
            for key, made in variants.items():
                clock.rows.clear()
                before = received_bytes(made[0])
                got = await drive(made[0], lambda i, ids=ids: ids[i], args.requests,
                                  concurrent, clock, seeded)
                got["bytes_received_per_request"] = round(
                    (received_bytes(made[0]) - before) / (args.requests + 3))
                label = name if key == "a" else f"{name}.compare"
                out.setdefault(label, []).append(got)
                print(label, json.dumps(got), flush=True)
    return out


def received_bytes(server: Any) -> int:
    """Bytes the caller received from its peer so far (hop answers and rows)."""
    return sum(s.received_bytes for s in server.peers.stats.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(main_async(args))
    path = Path(args.out_dir) / "profile.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
