"""Typed inductive requests (docs/decisions/0061-typed-inductive.md) against what a caller would
do without them, in one run on the ogbn-mag-shaped synthetic graph (reverse relations,
to_hetero(GraphSAGE), random weights), the typed engine core driven in this process:

1. inductive: a request of 47 paper ids and one new paper with 10 cited papers and 3 authors as
   in-neighbours (its features a random row), sampled and exact (full fanout) - the graph is
   unchanged after;
2. baseline: the same new paper written as a typed update (``TypedLiveGraph``: the node, then
   its edges along ``cites`` and ``writes``, reverses derived) and the 48 ids asked after,
   sampled and exact;
3. exact from the typed exact table (decision 0064): the same exact requests on a second core
   over its own copy of the graph with ``exact.materialize: on`` (``--table``), its rows
   compared with the same core's on the fly (max abs difference).

Per request p50 / p99 of each.

    python -m bench.typed.inductive --scale 0.1 --out bench/results/typed_inductive_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

from bench.typed.serve_mag import mag_config, percentiles_ms
from loadtest.results import run_meta, write_result
from quiver_serve.engine.client.checks import typed_inductive_nodes
from quiver_serve.engine.core.micro_batch import MicroBatch
from quiver_serve.engine.core.typed_core import build_typed_core
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.wire import NO_SEED, RELATION_SHIFT

NONE = torch.zeros((0, 2), dtype=torch.int64)


def request(core, rng: np.random.Generator, exact: bool, seq: int) -> MicroBatch:  # noqa: ANN001
    """47 paper ids and one new paper citing 10 papers, written by 3 authors."""
    g = core.graph
    ids = rng.integers(0, g.num_nodes["paper"], 47)
    mb = MicroBatch(b"c", seq, exact, NO_SEED, ids, np.array([47]),
                    np.array([time.time() + 60.0]))
    mb.node_type = "paper"
    new = {"cites": rng.integers(0, g.num_nodes["paper"], 10).tolist(),
           "writes": rng.integers(0, g.num_nodes["author"], 3).tolist()}
    nodes = typed_inductive_nodes([rng.standard_normal(g.feature_width("paper")).tolist()], [new])
    assert nodes is not None
    mb.new_features, mb.new_offsets, mb.new_neighbors = nodes[:3]
    mb.new_relations = nodes.relations
    return mb


def answer(core, mb: MicroBatch) -> np.ndarray:  # noqa: ANN001
    assert core.add(mb) is None
    rows = None
    while core.busy():
        for reply in core.step():
            assert not reply.done.errors, reply.done.errors
            rows = reply.rows
    assert rows is not None
    return rows


def as_update(core, live: TypedLiveGraph, mb: MicroBatch) -> None:  # noqa: ANN001
    """The baseline: the new paper added for real, then the 48 ids asked."""
    g = core.graph
    nid = live.add_nodes("paper", np.asarray(mb.new_features))[0]
    words = mb.new_neighbors & ((1 << RELATION_SHIFT) - 1)
    kind = mb.new_neighbors >> RELATION_SHIFT
    for k, name in enumerate(mb.new_relations):
        et = next(e for e in g.edge_types if e[1] == name and e[2] == "paper")
        pairs = torch.tensor([[int(s), nid] for s in words[kind == k]])
        live.apply_edges(et, pairs, NONE)
    core.rows("paper", torch.from_numpy(np.append(mb.ids, nid)), mb.exact, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--table", action="store_true", help="also exact requests from the table")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = mag_config(args.scale, "cpu", args.hidden, [25, 10])
    graph = load_typed_graph(cfg.graph)
    core = build_typed_core(cfg, graph)
    tabled = None
    if args.table:
        with_table = cfg.model_copy(deep=True)
        with_table.exact.materialize = "on"  # type: ignore[assignment]
        tabled = build_typed_core(with_table, load_typed_graph(cfg.graph))
    live = TypedLiveGraph(graph, add_reverse_edges=True)
    rng = np.random.default_rng(0)
    result: dict = {"graph": graph.describe()}
    for exact in (False, True):
        key = "exact" if exact else "sampled"
        virtual, update, table, diff = [], [], [], 0.0
        for i in range(args.requests):
            mb = request(core, rng, exact, i)
            if exact and tabled is not None:
                t0 = time.perf_counter()
                got = answer(tabled, copy.copy(mb))
                table.append(time.perf_counter() - t0)
                saved, tabled.table = tabled.table, None  # the same core's rows on the fly
                diff = max(diff, float(np.abs(answer(tabled, copy.copy(mb)) - got).max()))
                tabled.table = saved
            t0 = time.perf_counter()
            answer(core, mb)
            virtual.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            as_update(core, live, mb)
            update.append(time.perf_counter() - t0)
        result[key] = {"inductive": percentiles_ms(virtual), "update_then_ask": percentiles_ms(
            update)}
        if table:
            result[key].update(inductive_table=percentiles_ms(table), table_max_abs_diff=diff)
    print(result)
    if args.out:
        write_result(args.out, {"meta": run_meta(args, cfg, **vars(args)), "result": result})


if __name__ == "__main__":
    main()
