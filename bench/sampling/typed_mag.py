"""Typed sampling and a to_hetero model on the ogbn-mag-shaped synthetic graph (issue 41's
workload): reverse relations added, to_hetero(GraphSAGE) hidden 256, [25, 10] per relation,
batches of uniform paper ids.

Per sampler (the reference on the CPU, the C++ sampler, the reference's torch code on the GPU
when there is one) the p50/p99 time per batch, and the sampled subgraph per seed (nodes and edges,
per node type); per device the model's time per batch untrimmed (``TypedServedModel``) and trimmed
per layer (``TypedLayerwise.sampled``). Every sampler's output is checked equal to the reference's.

From the repository root:

    python -m bench.sampling.typed_mag --scale 1.0 --json typed_mag_cpu2_<date>.json
    OUT=results python -m bench.sampling.typed_mag   # on a GPU: the torch sampler there too
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from loadtest.results import add_result_options, result_path, run_meta, write_result
from quiver_serve.config import GraphConfig
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.models.typed_served import build_typed_model
from quiver_serve.sampling.cpu import cpp_sampler_available
from quiver_serve.sampling.typed import (
    TypedCppSampler,
    TypedReferenceSampler,
    TypedSamplerOutput,
)


def percentiles_ms(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3}


def timed(fn: Callable[[], object], sync: bool) -> tuple[object, float]:
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def same(a: TypedSamplerOutput, b: TypedSamplerOutput) -> bool:
    return all(torch.equal(a.node[t], b.node[t].cpu()) for t in a.node) and all(
        torch.equal(a.edge_index[et], b.edge_index[et].cpu()) for et in a.edge_index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="JSON file (default: $OUT/typed_mag_<machine>_<date>"
                        "[_<variant>].json when OUT is set, else none)")
    add_result_options(parser)
    a = parser.parse_args()
    if not a.json and os.environ.get("OUT"):
        a.json = str(result_path("typed_mag", a))
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    graph = load_typed_graph(GraphConfig(format="synthetic", synthetic_preset="mag",
                                         synthetic_scale=a.scale, add_reverse_edges=True))
    load_s = time.perf_counter() - t0
    print(f"{graph.describe()} ({load_s:.1f} s)", flush=True)
    samplers = {"reference": TypedReferenceSampler(graph)}
    if cpp_sampler_available():
        samplers["cpp"] = TypedCppSampler(graph)
    if torch.cuda.is_available():
        samplers["torch-cuda"] = TypedReferenceSampler(graph.to("cuda"))
    spec = ModelSpec("mag-sage", 1, "GraphSAGE", {"hidden_channels": 256, "num_layers": 2,
                                                  "out_channels": 64}, 2, None, None, 0, None,
                     None, {"aggr": "sum"})
    served = build_typed_model(spec, graph)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    times: dict[str, list[float]] = {k: [] for k in samplers}
    times.update({f"model-{d}-{m}": [] for d in devices for m in ("untrimmed", "trimmed")})
    sizes: list[dict[str, float]] = []
    gen = torch.Generator().manual_seed(0)
    for b in range(a.batches):
        seeds = torch.randint(0, graph.num_nodes["paper"], (a.batch,), generator=gen)
        want = None
        for name, sampler in samplers.items():
            out, s = timed(lambda: sampler.sample("paper", seeds, [25, 10], b),  # noqa: B023
                           name.endswith("cuda"))
            times[name].append(s)
            if want is None:
                want = out
            if not same(want, out):
                raise SystemExit(f"{name} differs from the reference at batch {b}")
        sizes.append({t: ids.numel() / a.batch for t, ids in want.node.items()}
                     | {"edges": want.num_edges / a.batch})
        for d in devices:
            served.to(d)
            layerwise = TypedLayerwise(served)
            times[f"model-{d}-untrimmed"].append(timed(lambda: served(want), d == "cuda")[1])  # noqa: B023
            times[f"model-{d}-trimmed"].append(timed(lambda: layerwise.sampled(want),  # noqa: B023
                                                     d == "cuda")[1])
    warm = max(1, a.batches // 10)
    rows = {k: percentiles_ms(v[warm:]) for k, v in times.items()}
    per_seed = {k: statistics.mean(s[k] for s in sizes) for k in sizes[0]}
    per_seed["nodes"] = sum(v for k, v in per_seed.items() if k != "edges")
    for k, v in rows.items():
        print(f"{k:>24}: p50 {v['p50_ms']:8.2f} ms  p99 {v['p99_ms']:8.2f} ms per {a.batch} seeds")
    print("per seed: " + ", ".join(f"{k} {v:.1f}" for k, v in per_seed.items()))
    if a.json:
        write_result(a.json, {"meta": run_meta(a, scale=a.scale, batch=a.batch,
                                               threads=a.threads, load_s=load_s,
                                               graph=graph.describe()),
                              "per_batch": rows, "per_seed": per_seed})


if __name__ == "__main__":
    main()
