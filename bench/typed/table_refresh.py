"""The typed exact table through updates (docs/decisions/0060-typed-table-refresh.md), against
what it replaces, in one run on the ogbn-mag-shaped synthetic graph (reverse relations,
to_hetero(GraphSAGE), random weights):

1. the table built at start (every layer of every node): the cost of a rebuild per update;
2. --records update records of --edges-per-record edges (added paper-cites-paper and
   author-writes-paper pairs, uniform, and --remove-fraction of them removals of present
   edges), each applied, marked (``TypedExactTable.mark``) and refreshed whole
   (``refresh``): time per record p50 / p99 and rows recomputed per record;
3. 48-id exact paper requests after the updates: read from the refreshed table, against the
   same ids computed on the fly (a sample with every fanout -1 and the model: what every exact
   request cost once the first update dropped the table); p50 / p99 and their ratio;
4. a check: refreshed rows equal a fresh layer-wise run of the updated graph.

    python -m bench.typed.table_refresh --scale 0.1 --out bench/results/typed_table_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.typed.serve_mag import mag_config, percentiles_ms
from loadtest.results import run_meta, write_result
from quiver_serve.engine.core.typed_core import build_typed_core
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.typed_layerwise import TypedLayerwise

RELATIONS = [("paper", "cites", "paper"), ("author", "writes", "paper")]


def record_for(live: TypedLiveGraph, version: int, rng: np.random.Generator, edges: int,
               remove_fraction: float) -> Any:
    """One edge record: uniform new pairs of a relation, and removals of present entries."""
    g = live.graph
    et = RELATIONS[version % len(RELATIONS)]
    removes = int(edges * remove_fraction)
    add = np.stack([rng.integers(0, g.num_nodes[et[0]], edges - removes),
                    rng.integers(0, g.num_nodes[et[2]], edges - removes)], 1)
    rel = g.relations[et]
    pos = rng.integers(0, rel.num_edges, removes)
    dst = np.searchsorted(rel.indptr.numpy(), pos, side="right") - 1
    remove = np.stack([rel.indices.numpy()[pos], dst], 1)
    return live.edge_record(version, time.time(), et, add, remove)


def exact_times(core: Any, requests: int, rng: np.random.Generator, from_table: bool,
                ) -> list[float]:
    """Seconds per 48-id exact paper request, from the table or on the fly."""
    table, times = core.table, []
    core.table = table if from_table else None
    try:
        for _ in range(requests):
            ids = torch.from_numpy(rng.integers(0, core.graph.num_nodes["paper"], 48))
            t0 = time.perf_counter()
            core.rows("paper", ids, True, 0)
            times.append(time.perf_counter() - t0)
    finally:
        core.table = table
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--records", type=int, default=30)
    ap.add_argument("--edges-per-record", type=int, default=2000)
    ap.add_argument("--remove-fraction", type=float, default=0.1)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = mag_config(args.scale, "cpu", args.hidden, [25, 10])
    cfg.exact.materialize = "on"
    graph = load_typed_graph(cfg.graph)
    t0 = time.perf_counter()
    core = build_typed_core(cfg, graph)
    build_s = time.perf_counter() - t0
    table = core.table
    live = TypedLiveGraph(graph, add_reverse_edges=True)
    live.watch_changes()
    table.follow_reverse(live)
    rng = np.random.default_rng(0)
    mark_s, refresh_s, rows = [], [], []
    for v in tqdm(range(1, args.records + 1), desc="update records", unit="record"):
        live.apply(record_for(live, v, rng, args.edges_per_record, args.remove_fraction))
        t0 = time.perf_counter()
        table.mark(live.take_changes())
        t1 = time.perf_counter()
        rows.append(table.refresh(float("inf")))
        mark_s.append(t1 - t0)
        refresh_s.append(time.perf_counter() - t1)
    on_table = exact_times(core, args.requests, rng, True)
    on_the_fly = exact_times(core, args.requests, rng, False)
    fresh = TypedLayerwise(core.served).run()
    err = max(float((table.layer(-1)[t] - fresh[t].float().cpu()).abs().max())
              for t in table.types())
    total = sum(graph.num_nodes.values()) * table.num_layers
    per_record = [a + b for a, b in zip(mark_s, refresh_s, strict=True)]
    result = {"graph": graph.describe(), "build_s": round(build_s, 2),
              "update_record": {"edges": args.edges_per_record, **percentiles_ms(per_record),
                                "mark": percentiles_ms(mark_s),
                                "refresh": percentiles_ms(refresh_s),
                                "rows_recomputed_mean": float(np.mean(rows)),
                                "rows_in_table": total},
              "rebuild_over_record_p50": round(build_s / (float(np.median(per_record)) or 1e-9), 1),
              "exact_48_ids": {"table": percentiles_ms(on_table),
                               "on_the_fly": percentiles_ms(on_the_fly)},
              "max_abs_error_vs_fresh_run": err}
    print(result)
    assert err <= 1e-4, err
    if args.out:
        write_result(args.out, {"meta": run_meta(args, cfg, **vars(args)), "result": result})


if __name__ == "__main__":
    main()
