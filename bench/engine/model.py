#!/usr/bin/env python
"""The engine's model compute per batch: PyG's layers (before) against the fast path (after).

One run, one process, on the engine's device: for each model class (GraphSAGE, GCN, GAT; hidden
256, two layers, the config's fanouts) and each batch size, seeds uniform over every node, one
sampled subgraph per batch size (the GPU sampler where present) shared by every variant:

* ``pyg``: PyG's own layers (``ServedModel.pyg``), fp32 - what the engine ran before;
* ``fp32``, ``tf32``, ``bf16``, ``fp16``: the fast path (``models/fast.py``) in that precision;

each timed as feature gather + forward + seed rows (median of ``--iters``, device sync around),
with its relative error against ``pyg`` (Frobenius norm of the difference over that of ``pyg``).
Then the fast path's time by layer at one batch size (CUDA events between layers). Prints
markdown tables; ``--out`` writes JSON.

Usage (repository root):
    python -m bench.engine.model [--config configs/bench_reddit.yaml] [--scale 0.02]
        [--batch-sizes 1 48 1536 4096 8192 16384] [--classes GraphSAGE GCN GAT] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from bench.engine.profile_engine import timed
from loadtest.results import add_set_option, load_config, run_meta, write_result
from quiver_serve.config import ServeConfig

VARIANTS = ["pyg", "fp32", "tf32", "bf16", "fp16"]
CLASS_KWARGS = {"GraphSAGE": {}, "GCN": {}, "GAT": {"heads": 4}}


def build_models(cfg: ServeConfig, cls: str, graph: Any, dev: torch.device) -> dict[str, Any]:
    """One ServedModel per variant, all with the same weights."""
    from quiver_serve.models.served import ServedModel, build_model

    cfg.model.pyg_class = cls
    cfg.model.kwargs = {**cfg.model.kwargs, **CLASS_KWARGS[cls]}
    cfg.model.kwargs = {k: v for k, v in cfg.model.kwargs.items()
                        if k != "heads" or cls == "GAT"}
    loops = graph.self_loop_count() if cls == "GCN" else None
    out = {}
    for v in VARIANTS:
        model = build_model(cfg.model, graph.num_features)  # same seed: same weights
        out[v] = ServedModel(model, graph.degree(), loops, precision="fp32" if v == "pyg" else v,
                             fast=v != "pyg").to(dev)
    return out


def forward_fn(served: Any, features: torch.Tensor, sb: Any, dev: torch.device, pyg: bool) -> Any:
    n_id = sb.n_id.to(dev)
    edges = sb.edge_index.to(dev, torch.int64)
    seed_index = sb.seed_index.to(dev)
    call = served.pyg if pyg else served

    def run() -> torch.Tensor:
        x = features.index_select(0, n_id)
        out = call(x, n_id, edges, sb.num_sampled_nodes, sb.num_sampled_edges, False)
        return out.index_select(0, seed_index).float()
    return run


def by_layer(served: Any, features: torch.Tensor, sb: Any, dev: torch.device,
             iters: int) -> list[float]:
    """Median ms per stage of the fast path: gather+cast, CSR build, then each layer."""
    from quiver_serve.models.fast import BatchGraph, GcnLayer, tf32_matmul

    fast = served.fast
    n_id, edges = sb.n_id.to(dev), sb.edge_index.to(dev, torch.int64)
    times: list[list[float]] = []
    for _ in range(iters):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(fast.layers) + 3)]
        marks[0].record()
        x = features.index_select(0, n_id).to(fast.dtype)
        marks[1].record()
        graph = BatchGraph(edges, sb.num_sampled_nodes, sb.num_sampled_edges,
                           fast.sparse[fast.dtype])
        marks[2].record()
        with tf32_matmul(fast.tf32):
            for i, layer in enumerate(fast.layers):
                g = graph.layer(i)
                x = layer(x, g, n_id, False) if isinstance(layer, GcnLayer) else layer(x, g)
                if i < len(fast.layers) - 1 and fast.act is not None:
                    x = fast.act(x)
                marks[i + 3].record()
        torch.cuda.synchronize(dev)
        times.append([marks[j].elapsed_time(marks[j + 1]) for j in range(len(marks) - 1)])
    return [float(v) for v in np.median(np.asarray(times), axis=0)]


def class_rows(cfg: ServeConfig, cls: str, graph: Any, features: torch.Tensor, sampler: Any,
               args: argparse.Namespace, dev: torch.device) -> tuple[list[dict], dict]:
    models = build_models(cfg, cls, graph, dev)
    features_bf16 = features.to(torch.bfloat16)
    rng = np.random.default_rng(0)
    rows, layers = [], {}
    for b in args.batch_sizes:
        seeds = torch.from_numpy(rng.integers(0, graph.num_nodes, b).astype(np.int64))
        sample_s, sb = timed(lambda s=seeds: sampler.sample(s, cfg.sampling.fanouts, 7), dev, 5)
        iters = args.iters if b <= 4096 else max(args.iters // 2, 3)
        ref = None
        row: dict[str, Any] = {"class": cls, "batch_seeds": b, "sampled_nodes": sb.num_nodes,
                               "nodes_per_hop": sb.num_sampled_nodes,
                               "sampled_edges": sb.num_edges, "sample_ms": sample_s * 1e3}
        for v in VARIANTS:
            fn = forward_fn(models[v], features, sb, dev, pyg=v == "pyg")
            if v == "bf16":  # features stored in bf16 too (inference.feature_dtype): half the gather
                half_fn = forward_fn(models[v], features_bf16, sb, dev, pyg=False)
                row["bf16_features_bf16_ms"] = timed(half_fn, dev, iters)[0] * 1e3
            ms, out = timed(fn, dev, iters)
            row[f"{v}_ms"] = ms * 1e3
            if ref is None:
                ref = out
            row[f"{v}_rel_err"] = float((out - ref).norm() / ref.norm().clamp(min=1e-12))
        if cls == "GraphSAGE":  # the projection-order rule against both fixed orders
            for order in ("transform", "aggregate"):
                for layer in models["fp32"].fast.layers:
                    layer.order = order
                fn = forward_fn(models["fp32"], features, sb, dev, pyg=False)
                row[f"fp32_{order}_first_ms"] = timed(fn, dev, iters)[0] * 1e3
                for layer in models["fp32"].fast.layers:
                    layer.order = "auto"
        rows.append(row)
        print(f"| {cls} | {b:,} | {sb.num_nodes:,} | {sb.num_edges:,} | {row['sample_ms']:.3f} | "
              + " | ".join(f"{row[f'{v}_ms']:.3f}" for v in VARIANTS)
              + f" | {row['bf16_features_bf16_ms']:.3f} | {row['pyg_ms'] / row['fp32_ms']:.2f}x"
              f" | {row['bf16_rel_err']:.1e} |",
              flush=True)
        if b == args.layer_batch and dev.type == "cuda":
            layers = {v: by_layer(models[v], features, sb, dev, iters) for v in VARIANTS[1:]}
    return rows, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bench_reddit.yaml")
    ap.add_argument("--scale", type=float, help="override graph.synthetic_scale")
    ap.add_argument("--batch-sizes", nargs="+", type=int,
                    default=[1, 48, 1536, 4096, 8192, 16384])
    ap.add_argument("--classes", nargs="+", default=list(CLASS_KWARGS), choices=list(CLASS_KWARGS))
    ap.add_argument("--layer-batch", type=int, default=4096, help="batch of the by-layer table")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="JSON file")
    add_set_option(ap)
    args = ap.parse_args()
    from quiver_serve.engine.core.samplers import gpu_sampler_or_none, local_sampler
    from quiver_serve.graph.datasets import load_graph

    cfg = load_config(args.config, args.sets)
    if args.scale is not None:
        cfg.graph.synthetic_scale = args.scale
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graph = load_graph(cfg.graph)
    features = graph.x.to(dev)
    sampler = gpu_sampler_or_none(cfg, graph, dev) or local_sampler(cfg, graph, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
          f"{graph.num_features} features; {name}; sampler {sampler.name}; fanouts "
          f"{cfg.sampling.fanouts}; seeds uniform\n", flush=True)
    print("| model | seeds | sampled nodes | sampled edges | sample ms | "
          + " | ".join(f"{v} ms" for v in VARIANTS)
          + " | bf16, bf16 features ms | pyg/fp32 | bf16 rel. err |")
    print("|---" * (8 + len(VARIANTS)) + "|")
    t0 = time.perf_counter()
    rows, layer_ms = [], {}
    for cls in args.classes:
        r, lay = class_rows(cfg, cls, graph, features, sampler, args, dev)
        rows += r
        layer_ms[cls] = lay
    sage = [r for r in rows if "fp32_transform_first_ms" in r]
    if sage:
        print("\nGraphSAGE fp32, projection order (ms): seeds | auto | transform first | "
              "aggregate first")
        for r in sage:
            print(f"  {r['batch_seeds']:,} | {r['fp32_ms']:.3f} | "
                  f"{r['fp32_transform_first_ms']:.3f} | {r['fp32_aggregate_first_ms']:.3f}")
    print(f"\nfast path by stage at {args.layer_batch:,} seeds (ms: gather+cast | CSR | layer 1 | "
          "layer 2 ...):")
    for cls, per in layer_ms.items():
        for v, ms in per.items():
            print(f"  {cls:9s} {v}: " + " | ".join(f"{m:.3f}" for m in ms))
    print(f"\n(bench took {time.perf_counter() - t0:.0f} s)")
    if args.out:
        write_result(args.out, {"meta": run_meta(args, cfg), "device": name, "rows": rows,
                                "by_layer_ms": layer_ms, "layer_batch": args.layer_batch})


if __name__ == "__main__":
    main()
