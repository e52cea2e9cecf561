"""What applying a typed update costs an engine core (docs/architecture.md, "Typed graphs";
docs/decisions/0048-typed-updates.md): the ogbn-mag-shaped synthetic graph with reverse
relations, batches of --batch-edges pairs per relation (a --remove-fraction of them removing
edges there), each encoded and decoded as the log carries it and applied
(``TypedLiveGraph.apply``: the relation's CSC rebuilt, its ``rev_`` relation too, both
directions of a relation within a type). Per relation: the relation's size, the p50 / p99 /
max milliseconds per batch, and the p50 of copying its CSC arrays once (the floor of any
rebuild, on the same machine at the same time); the seeded C++ sample is checked equal to the
reference's after.

From the repository root:

    python -m bench.graph.typed_apply --scale 0.05
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.sampling.typed_mag import percentiles_ms, same
from loadtest.results import add_result_options, result_path, run_meta, write_result
from quiver_serve.config import GraphConfig
from quiver_serve.graph.records import decode, encode
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.sampling.typed import TypedCppSampler, TypedReferenceSampler

RELATIONS = [("author", "writes", "paper"), ("paper", "cites", "paper"),
             ("paper", "has_topic", "field_of_study")]


def batch(live: TypedLiveGraph, et: tuple, n: int, remove_fraction: float,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    g = live.graph
    n_rm = int(n * remove_fraction)
    add = np.stack([rng.integers(0, g.num_nodes[et[0]], n - n_rm),
                    rng.integers(0, g.num_nodes[et[2]], n - n_rm)], 1)
    rel = g.relations[et]
    pos = torch.from_numpy(rng.integers(0, rel.num_edges, n_rm))
    dst = torch.searchsorted(rel.indptr, pos, right=True) - 1
    remove = torch.stack([rel.indices[pos], dst], 1).numpy()
    return add, remove


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--batch-edges", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--remove-fraction", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", help="JSON file (default: typed_apply_<machine>_<date>.json)")
    add_result_options(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    graph = load_typed_graph(GraphConfig(format="synthetic", synthetic_preset="mag",
                                         synthetic_scale=a.scale, add_reverse_edges=True))
    print(graph.describe(), flush=True)
    live = TypedLiveGraph(graph, add_reverse_edges=True)
    rng = np.random.default_rng(0)
    rows = {}
    version = 0
    for et in RELATIONS:
        times_s = []
        for _ in range(a.batches):
            add, remove = batch(live, et, a.batch_edges, a.remove_fraction, rng)
            version += 1
            record, _ = decode(encode(live.edge_record(version, 0.0, et, add, remove)))
            t0 = time.perf_counter()
            live.apply(record)
            times_s.append(time.perf_counter() - t0)
        rel = graph.relations[et]
        copy_s = []
        for _ in range(a.batches):
            t0 = time.perf_counter()
            rel.indices.clone(), rel.edge_ids().clone(), rel.indptr.clone()
            copy_s.append(time.perf_counter() - t0)
        rows["__".join(et)] = {"edges": rel.num_edges, **percentiles_ms(times_s),
                               "max_ms": max(times_s) * 1e3,
                               "copy_p50_ms": percentiles_ms(copy_s)["p50_ms"]}
        print(f"{'-'.join(et)}: {rows['__'.join(et)]}", flush=True)
    seeds = torch.from_numpy(rng.integers(0, graph.num_nodes["paper"], 48))
    fanouts = [25, 10]
    equal = same(TypedReferenceSampler(graph).sample("paper", seeds, fanouts, 7),
                 TypedCppSampler(graph).sample("paper", seeds, fanouts, 7))
    print(f"C++ sample equals the reference's after the updates: {equal}")
    out = {"meta": run_meta(a, graph=graph.describe()), "relations": rows,
           "cpp_equals_reference": equal}
    write_result(a.out or result_path("typed_apply", a), out)


if __name__ == "__main__":
    main()
