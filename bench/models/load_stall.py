"""What a model load costs the engine loop, step by step, in one process (decision 0040).

One engine core (``build_core``) on the embedded Cora graph, or on a synthetic graph of
``--nodes`` nodes and ``--degree`` in-edges each, serves a closed loop of sampled and exact
micro-batches; a new version of its model is loaded in the middle. Per engine step the loop's
seconds are recorded, and reported for three windows: steady (before the load), load (from the
call to its answer: loader thread beside the loop) and table (from the answer until the new
version's exact table is built by the loop, ``models.table_build_step_ms`` per step). Also the
build's chunk seconds, chunks per step and steps.

    python -m bench.models.load_stall [--device cuda] [--nodes 200000 --degree 50]
        [--budget-ms 2] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.core import EngineCore
from quiver_serve.engine.core.micro_batch import MicroBatch
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.spec import ModelSpec
from quiver_serve.wire import NO_SEED

SAGE_KW = {"hidden_channels": 128, "num_layers": 2, "out_channels": 64}


def synthetic(nodes: int, degree: int, features: int, seed: int = 0) -> GraphData:
    rng = np.random.default_rng(seed)
    dst = np.repeat(np.arange(nodes, dtype=np.int64), degree)
    src = rng.integers(0, nodes, nodes * degree, dtype=np.int64)
    x = torch.from_numpy(rng.standard_normal((nodes, features), dtype=np.float32))
    return GraphData.from_edge_index(torch.from_numpy(np.stack([src, dst])), x, "synthetic")


def config(device: str, budget_ms: float) -> ServeConfig:
    cfg = ServeConfig.default()
    cfg.graph.update_log_dir = tempfile.mkdtemp(prefix="quiver-stall-")
    cfg.model.weights = None
    cfg.inference.device = device
    cfg.exact.materialize = "on"
    cfg.models.table_build_step_ms = budget_ms
    return cfg


def micro_batch(seq: int, num_nodes: int, exact: bool, rng: np.random.Generator) -> MicroBatch:
    ids = rng.integers(0, num_nodes, 4 if exact else 64, dtype=np.int64)
    return MicroBatch(b"c", seq, exact, NO_SEED, ids, np.array([ids.size], np.int64),
                      np.array([time.time() + 30.0]))


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {"steps": len(values), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def run(core: EngineCore, num_nodes: int, steady_s: float) -> dict[str, Any]:
    """Step the core with a few micro-batches always in hand; load version 2 after
    ``steady_s``; stop once its table is built (or 120 s)."""
    rng = np.random.default_rng(1)
    windows: dict[str, list[float]] = {"steady": [], "load": [], "table": []}
    done: list[Any] = []
    seq, in_hand, phase = 0, 0, "steady"
    start, build, load_at, answered_s = time.monotonic(), None, 0.0, None
    while time.monotonic() - start < 120:
        while in_hand < 8:
            refused = core.add(micro_batch(seq, num_nodes, seq % 4 == 0, rng))
            seq, in_hand = seq + 1, in_hand + (refused is None)
        t0 = time.perf_counter()
        replies = core.step()
        windows[phase].append(time.perf_counter() - t0)
        in_hand -= len(replies)
        if phase == "steady" and time.monotonic() - start > steady_s:
            spec = ModelSpec(core.primary.name, 2, "GraphSAGE", dict(SAGE_KW), 2,
                             random_init_seed=2)
            core.loads.load(spec, lambda r, e: done.append((r, e)))
            phase, load_at = "load", time.monotonic()
        elif phase == "load" and done:
            assert done[0][1] is None, done[0][1]
            core.models.set_traffic(core.primary.name, {2: 1.0})
            core.loads.follow_table(core.primary.name)
            builds = core.loads.table_builds()
            build = builds[0] if builds else None
            phase, answered_s = "table", time.monotonic() - load_at
        elif phase == "table" and not core.loads.building:
            break
    out: dict[str, Any] = {k: percentiles_ms(v) for k, v in windows.items()}
    out["load_answered_s"] = answered_s
    if build is not None:
        out["build"] = {"steps": build.steps, "chunks": build.chunks_done,
                        "compute_s": build.compute_s,
                        "chunks_per_step_max": max(build.chunks_per_step, default=0)}
    out["load_s"] = core.models.get(core.primary.name, 2).load_s if done else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--nodes", type=int, default=0, help="synthetic graph (0: Cora)")
    ap.add_argument("--degree", type=int, default=20)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--budget-ms", type=float, default=2.0)
    ap.add_argument("--steady-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = config(args.device, args.budget_ms)
    if args.nodes:
        graph = synthetic(args.nodes, args.degree, args.features)
    else:
        from quiver_serve.graph.datasets import load_graph

        graph = load_graph(cfg.graph)
    core = build_core(cfg, graph, 0, None)
    result = {"device": args.device, "nodes": graph.num_nodes, "budget_ms": args.budget_ms,
              **run(core, graph.num_nodes, args.steady_s)}
    text = json.dumps(result, indent=1, default=float)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
