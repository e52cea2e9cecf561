#!/usr/bin/env python
"""Feature store on two GPUs (issue 11): replicate vs partition on an ogbn-papers100M-scale
synthetic graph, features in pinned host memory and a hot set on the GPUs.

Per budget (fraction of the feature bytes per GPU): ``replicate`` (GPU 0 holds the hottest rows;
GPU 1 would hold the same) vs ``partition`` (GPUs 0 and 1, a peer-access clique detected at run
time, split a hot set twice as large; GPU 0 reads GPU 1's share over NVLink), plus all-host:
hit rate (GPU 0 + peer) and gather GB/s from GPU 0 over a trace of sampled batches (workload (b),
1,024 seeds, [25, 10], FAP order). Full size (111 M nodes, 1.6 B edges, 57 GB of features) takes
minutes to generate alone: ``--scale`` (default 0.1) sets the size. JSON to --out (default: $OUT,
else bench/results/, features_2gpu_<machine>_<date>[_<variant>].json).
    python -m bench.features.features_2gpu [--scale 0.1] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.features.common import (
    make_graph,
    sampler_for,
    scores_by,
    seed_batches,
    store_point,
    trace,
)
from loadtest.results import add_result_options, result_path, run_meta, write_result
from quiver_serve.features.placement import peer_clique


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="papers100m")
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path)
    add_result_options(ap)
    args = ap.parse_args()
    if args.smoke:
        args.scale, args.batches, args.iters, args.batch = 0.001, 3, 1, 256
    gpus = torch.cuda.device_count()
    devs = [torch.device("cuda", i) for i in range(min(gpus, 2))] or [torch.device("cpu")] * 2
    clique = peer_clique([d.index for d in devs]) if gpus >= 2 else []
    print(f"GPUs {gpus}; peer-access clique {clique}", flush=True)
    graph, gen_s = make_graph(args.preset, args.scale)
    print(f"{args.preset} scale {args.scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} "
          f"edges, generated in {gen_s:.0f} s", flush=True)
    dev = devs[0]
    scores = scores_by(graph, dev, args.batch)
    n_ids = trace(graph, sampler_for(graph, dev), seed_batches("b", graph, args.batch,
                                                                args.batches, 1))
    feat_bytes = graph.num_nodes * graph.num_features * 4
    rows = []
    points = [("all-host", "replicate", 0)] + [
        (f"{int(f * 100)}%", policy, int(f * feat_bytes)) for f in args.budgets
        for policy in ("replicate", "partition")]
    for label, policy, budget in points:
        shards = devs if policy == "partition" and (len(clique) >= 2 or gpus < 2) else devs[:1]
        r = store_point(graph, dev, shards, scores["fap"], budget, policy, n_ids, args.iters)
        r.update(budget=label, policy=policy, shards=[str(d) for d in shards])
        rows.append(r)
        print(f"{label:>8s} {policy:9s} hit {r['hit_rate']:.3f} gather {r['gather_gb_s']:7.1f} "
              f"GB/s  GPU bytes {r['gpu_bytes']}", flush=True)
    result = {"meta": run_meta(args), "device": [torch.cuda.get_device_name(i)
                                                 for i in range(gpus)], "gpus": gpus,
              "peer_clique": clique, "graph": {"preset": args.preset, "scale": args.scale,
                                              "nodes": graph.num_nodes, "edges": graph.num_edges,
                                              "generate_s": gen_s}, "fap_s": scores["fap_s"],
              "rows": rows}
    write_result(result_path("features_2gpu", args, "smoke" if args.smoke else None), result)
    print("\n| budget/GPU | policy | hit rate | gather GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['policy']} | {r['hit_rate']:.3f} | {r['gather_gb_s']:.1f} |")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
