"""Exact inductive requests from the exact table (docs/decisions/0064-inductive-from-table.md)
against the on-the-fly path they took before, in one run on the graph of --config (default the
Reddit-shaped synthetic graph, --scale of it), GraphSAGE with random weights: two engine cores over
the same graph and update log, driven in this process, one with ``exact.materialize: on`` (the
table) and the baseline with ``off``.

Requests: one new node with --in-neighbors uniform in-neighbours (``new_nodes``, exact), alone and
beside --ids uniform ids. Per request p50 / p99 of each core, and the ratio; the rows of the two
cores are compared (max abs difference).

    python -m bench.graph.inductive --scale 0.05 --out bench/results/inductive_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.typed.serve_mag import percentiles_ms
from loadtest.results import load_config, run_meta, write_result
from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.micro_batch import MicroBatch
from quiver_serve.graph.datasets import load_graph
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import GraphWriter
from quiver_serve.wire import NO_SEED


def request(rng: np.random.Generator, n: int, width: int, ids: int, in_neighbors: int,
            seq: int) -> MicroBatch:
    asked = rng.integers(0, n, ids)
    mb = MicroBatch(b"c", seq, True, NO_SEED, asked, np.array([ids]),
                    np.array([time.time() + 120.0]))
    mb.new_features = rng.standard_normal((1, width)).astype(np.float32)
    mb.new_offsets = np.array([0, in_neighbors], np.int64)
    mb.new_neighbors = rng.integers(0, n, in_neighbors).astype(np.int64)
    return mb


def answer(core: Any, mb: MicroBatch) -> np.ndarray:
    assert core.add(mb) is None
    while True:
        for reply in core.step():
            assert not reply.done.errors, reply.done.errors
            return reply.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_reddit.yaml")
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--in-neighbors", type=int, default=20)
    ap.add_argument("--ids", type=int, nargs="+", default=[0, 47])
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"graph.synthetic_scale={args.scale}",
                                    "inference.device=cpu", "sampling.num_cpu_workers=0",
                                    "graph.max_new_nodes=1024"])
    cfg.sampling.calibration = "off"
    graph = load_graph(cfg.graph)
    with tempfile.TemporaryDirectory() as tmp:
        log = UpdateLog(Path(tmp))
        log.open()
        writer = GraphWriter(cfg.graph, graph, 0, log)
        live = LiveGraphArgs(tmp, 0, writer.caps, writer.state.tensor)
        cores = {}
        for name, materialize in (("table", "on"), ("on_the_fly", "off")):
            c = cfg.model_copy(deep=True)
            c.exact.materialize = materialize  # type: ignore[assignment]
            t0 = time.perf_counter()
            cores[name] = build_core(c, graph, 0, None, live=live)
            print(f"{name}: core built in {time.perf_counter() - t0:.1f} s", flush=True)
        result: dict[str, Any] = {"graph": {"nodes": graph.num_nodes, "edges": graph.num_edges}}
        for ids in args.ids:
            times: dict[str, list[float]] = {name: [] for name in cores}
            diff = 0.0
            rng = np.random.default_rng(ids)
            for i in range(args.requests):
                mb = request(rng, graph.num_nodes, graph.num_features, ids, args.in_neighbors, i)
                rows = {}
                for name, core in cores.items():
                    copy = MicroBatch(mb.client, mb.seq, True, NO_SEED, mb.ids, mb.lengths,
                                      mb.deadlines_s)
                    copy.new_features, copy.new_offsets, copy.new_neighbors = \
                        mb.new_features, mb.new_offsets, mb.new_neighbors
                    t0 = time.perf_counter()
                    rows[name] = answer(core, copy)
                    times[name].append(time.perf_counter() - t0)
                diff = max(diff, float(np.abs(rows["table"] - rows["on_the_fly"]).max()))
            got = {name: percentiles_ms(t) for name, t in times.items()}
            got["speedup_p50"] = got["on_the_fly"]["p50_ms"] / got["table"]["p50_ms"]
            got["max_abs_diff"] = diff
            result[f"ids_{ids}"] = got
            print(ids, got, flush=True)
        for core in cores.values():
            if core.exact_table is not None:
                core.exact_table.stop()
        log.close()
    if args.out:
        write_result(args.out, {"meta": run_meta(args, cfg, **vars(args)), "result": result})


if __name__ == "__main__":
    main()
