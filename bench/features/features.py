#!/usr/bin/env python
"""Feature store and adjacency cache on one GPU (docs/architecture.md, "Feature store").

1. Gather (Reddit- and ogbn-products-scale synthetic graphs): for budgets of 5/10/20/40% of the
   feature bytes (location map included), the hit rate and gather GB/s of FAP order (uniform
   seeds; and, for workload (a), FAP from a request log of that workload) vs in-degree order, and
   all-host / all-GPU, over a trace of sampled batches (1,024 seeds, [25, 10]) of workloads (a)
   (hot set of 1,500 nodes) and (b) (uniform). Hit rates are the store's own per-row counts,
   checked against the placement; every gather is checked against ``x[n_id]``.
2. Engine (Reddit): engine-direct seeds/s and p99 at batch sizes of workloads (a)/(b) with a 20%
   budget vs all features on the GPU, and with fp16 storage at 20% (plus its embedding error
   against fp32 storage on the same seeded batches).
3. Adjacency (Reddit, GPU only): UVA sampling with a 20% adjacency cache vs plain UVA vs the
   device-resident CSC at 1,024 and 8,192 seeds (samples checked bit-identical).

JSON to --out (default: $OUT, else bench/results/, features_<machine>_<date>[_<variant>].json); a
short table last. ``--smoke`` runs everything at a tiny scale (CPU too) to catch errors before a
GPU run.
    python -m bench.features.features [--smoke] [--reddit-scale 1] [--products-scale 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.features.common import (
    FANOUTS,
    hot_set,
    make_graph,
    sampler_for,
    scores_by,
    seed_batches,
    store_point,
    sync,
    timed,
    trace,
)
from loadtest.results import ROOT, add_result_options, result_path, run_meta, write_result


def gather_rows(preset: str, graph: Any, dev: torch.device, args: argparse.Namespace) -> list[dict]:
    shards = [dev]  # on a CPU box a CPU tensor stands in for the GPU shard (the torch twin)
    sampler = sampler_for(graph, dev)
    logged = np.concatenate([s.numpy() for s in seed_batches("a", graph, args.batch, 50, 99)])
    scores = scores_by(graph, dev, args.batch, logged)
    feat_bytes = graph.num_nodes * graph.num_features * 4
    rows = []
    for w in ("a", "b"):
        n_ids = trace(graph, sampler, seed_batches(w, graph, args.batch, args.batches, 1))
        points = [("all-host", "fap", 0), ("all-gpu", "fap", 1 << 62)]
        for frac in args.budgets:
            for order in ("fap", "degree") + (("fap-log",) if w == "a" else ()):
                points.append((f"{int(frac * 100)}%", order, int(frac * feat_bytes)))
        for label, order, budget in points:
            r = store_point(graph, dev, shards, scores[order], budget, "replicate", n_ids,
                            args.iters)
            r.update(graph=preset, workload=w, budget=label, budget_bytes=min(budget, feat_bytes),
                     order=order if label.endswith("%") else label, fap_s=scores["fap_s"])
            rows.append(r)
            print(f"{preset:9s} ({w}) {label:>8s} {r['order']:8s} hit {r['hit_rate']:.3f} "
                  f"gather {r['gather_gb_s']:8.1f} GB/s", flush=True)
    del sampler
    return rows


def engine_rows(graph: Any, args: argparse.Namespace) -> list[dict]:
    from bench.engine.pipeline import draw_requests, engine_point
    from quiver_serve.config import ServeConfig
    from quiver_serve.engine.core.build import build_core

    cfg = ServeConfig.from_yaml(ROOT / "configs" / "bench_reddit.yaml")
    cfg.batching.queue_capacity = 1 << 16
    feat_bytes = graph.num_nodes * graph.num_features * 4
    hot = hot_set(graph.degree().numpy())
    variants = [("all-gpu", 1 << 62, "fp32"), ("20%", int(0.2 * feat_bytes), "fp32"),
                ("20%-fp16", int(0.2 * feat_bytes), "fp16")]
    rows, seeded = [], {}
    for label, budget, dtype in variants:
        cfg.inference.gpu_cache_bytes, cfg.features.storage_dtype = budget, dtype
        core = build_core(cfg, graph, 0, None)
        for w in ("a", "b"):
            reqs = draw_requests(w, 4096, 48, graph.num_nodes, hot, np.random.default_rng(1))
            for b in args.engine_batches:
                r = engine_point(core, reqs, max(b // 48, 1), args.engine_seconds, 10.0, False)
                rows.append({"variant": label, "workload": w, **r})
                print(f"engine {label:9s} ({w}) batch {r['batch_seeds']:5d}: "
                      f"{r['seeds_per_s']:11,.0f} seeds/s p99 {r['p99_ms']:.2f} ms", flush=True)
        seeded[label] = seeded_rows(core, graph)
        del core
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = seeded["all-gpu"]
    for label, out in seeded.items():
        err = float(np.linalg.norm(out - base) / np.linalg.norm(base))
        rows.append({"variant": label, "embedding_rel_err_vs_fp32": err})
        print(f"engine {label:9s} embedding error vs fp32 features: {err:.2e}", flush=True)
    return rows


def seeded_rows(core: Any, graph: Any) -> np.ndarray:
    """Embeddings of 512 ids in seeded batches (the same subgraphs on every variant)."""
    from quiver_serve.engine.core.core import MicroBatch

    ids = np.random.default_rng(7).integers(0, graph.num_nodes, 512, dtype=np.int64)
    mb = MicroBatch(b"", 1, False, 1234, ids, np.array([512]), np.array([time.time() + 60]))
    core.add(mb)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in core.step():
            return np.array(r.rows, copy=True)
    raise RuntimeError("seeded batch not answered")


def adjacency_rows(graph: Any, dev: torch.device, args: argparse.Namespace) -> list[dict]:
    from quiver_serve.sampling.gpu import CudaSampler, UvaSampler
    from quiver_serve.sampling.graph_cache.adjacency import build_adjacency_cache, expansion_scores

    csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
    t0 = time.perf_counter()
    scores = expansion_scores(graph.indptr, graph.indices, FANOUTS, args.batch)
    cache = build_adjacency_cache(graph.indptr, graph.indices, scores, int(0.2 * csc_bytes), dev)
    build_s = time.perf_counter() - t0
    samplers = {"device": CudaSampler(graph.indptr, graph.indices, device=dev),
                "uva": UvaSampler(graph.indptr, graph.indices, device=dev),
                "uva+cache20%": UvaSampler(graph.indptr, graph.indices, device=dev,
                                           adjacency_cache=cache)}
    rows = []
    for n in (1024, 8192):
        seeds = torch.randint(0, graph.num_nodes, (n,))
        ref = samplers["uva"].sample(seeds, FANOUTS, 3)
        for name, s in samplers.items():
            got = s.sample(seeds, FANOUTS, 3)
            identical = torch.equal(got.n_id, ref.n_id) and torch.equal(got.edge_index,
                                                                         ref.edge_index)
            sec = timed(lambda s=s, x=seeds: s.sample(x, FANOUTS, 3), dev, args.iters * 10)
            rows.append({"sampler": name, "seeds": n, "sample_ms": sec * 1e3,
                         "identical_to_uva": identical, "cache_bytes": cache.nbytes if cache
                         else 0, "cached_lists": cache.num_cached if cache else 0,
                         "cache_build_s": build_s})
            print(f"adjacency {name:13s} {n:5d} seeds: {sec * 1e3:.3f} ms identical {identical}",
                  flush=True)
    for s in samplers.values():
        getattr(s, "close", lambda: None)()
    return rows


def table(result: dict) -> None:
    print("\n| graph | workload | budget | FAP hit | degree hit | FAP-log hit | FAP GB/s | degree GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["graph"], r["workload"], r["budget"], r["order"]): r for r in result["gather"]}
    for (g, w, b, o), r in by.items():
        if o in ("all-host", "all-gpu"):
            print(f"| {g} | {w} | {o} | {r['hit_rate']:.3f} | | | {r['gather_gb_s']:.1f} | |")
        elif o == "fap":
            d, lg = by[(g, w, b, "degree")], by.get((g, w, b, "fap-log"))
            print(f"| {g} | {w} | {b} | {r['hit_rate']:.3f} | {d['hit_rate']:.3f} | "
                  f"{lg['hit_rate']:.3f} | " if lg else f"| {g} | {w} | {b} | {r['hit_rate']:.3f}"
                  f" | {d['hit_rate']:.3f} | - | ", end="")
            print(f"{r['gather_gb_s']:.1f} | {d['gather_gb_s']:.1f} |")
    eng = [r for r in result["engine"] if "seeds_per_s" in r]
    if eng:
        print("\n| engine | workload | batch | seeds/s | p99 ms | vs all-gpu |")
        print("|---|---|---|---|---|---|")
        base = {(r["workload"], r["batch_seeds"]): r["seeds_per_s"] for r in eng
                if r["variant"] == "all-gpu"}
        for r in eng:
            ratio = r["seeds_per_s"] / base[(r["workload"], r["batch_seeds"])]
            print(f"| {r['variant']} | {r['workload']} | {r['batch_seeds']} | "
                  f"{r['seeds_per_s']:,.0f} | {r['p99_ms']:.2f} | {ratio:.2f} |")
    if result["adjacency"]:
        print("\n| sampler | seeds | ms | identical |")
        print("|---|---|---|---|")
        for r in result["adjacency"]:
            print(f"| {r['sampler']} | {r['seeds']} | {r['sample_ms']:.3f} | "
                  f"{r['identical_to_uva']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny graphs and short runs (any box)")
    ap.add_argument("--reddit-scale", type=float, default=1.0)
    ap.add_argument("--products-scale", type=float, default=1.0)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    ap.add_argument("--batch", type=int, default=1024, help="seeds per traced batch")
    ap.add_argument("--batches", type=int, default=30, help="traced batches per workload")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[48, 768, 3072])
    ap.add_argument("--engine-seconds", type=float, default=1.5)
    ap.add_argument("--sections", nargs="+", default=["gather", "engine", "adjacency"])
    ap.add_argument("--out", type=Path)
    add_result_options(ap)
    args = ap.parse_args()
    if args.smoke:
        args.reddit_scale, args.products_scale = 0.01, 0.005
        args.batches, args.iters, args.engine_seconds = 4, 1, 0.3
        args.batch, args.engine_batches = 256, [48, 480]
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    result: dict[str, Any] = {"meta": run_meta(args), "args": vars(args) | {
                                  "out": str(args.out)}, "graphs": {}, "gather": [],
                              "engine": [], "adjacency": []}
    t_start = time.perf_counter()
    out = result_path("features", args, "smoke" if args.smoke else None)

    def save() -> None:  # after every section: a run cut by its time limit keeps what it did
        result["wall_s"] = time.perf_counter() - t_start
        write_result(out, result)

    for preset, scale in (("reddit", args.reddit_scale), ("products", args.products_scale)):
        graph, gen_s = make_graph(preset, scale)
        result["graphs"][preset] = {"scale": scale, "nodes": graph.num_nodes,
                                    "edges": graph.num_edges, "features": graph.num_features,
                                    "generate_s": gen_s}
        print(f"{preset} scale {scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
              f"generated in {gen_s:.1f} s", flush=True)
        if "gather" in args.sections:
            result["gather"] += gather_rows(preset, graph, dev, args)
            save()
        if preset == "reddit" and "adjacency" in args.sections and dev.type == "cuda":
            result["adjacency"] = adjacency_rows(graph, dev, args)
            save()
        if preset == "reddit" and "engine" in args.sections:
            result["engine"] = engine_rows(graph, args)
            save()
        del graph
        gc.collect()
    sync(dev)
    save()
    print(f"wall {result['wall_s']:.0f} s")
    table(result)


if __name__ == "__main__":
    main()
