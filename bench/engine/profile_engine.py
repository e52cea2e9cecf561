#!/usr/bin/env python
"""Where one batch's time goes inside the engine core, per stage and batch size.

For each batch size B (seed ids drawn as in bench.engine.pipeline's workloads), on the engine core's
device, medians over --iters batches, each stage timed alone with a device sync around it:

* ``sample``: the faster of the engine's own samplers for this batch (GPU kernel or C++), which
  is what the cost-model router picks when nothing waits;
* ``eager``: feature gather + model + seed rows, PyG eagerly (host time = launch overhead when the
  GPU is idle);
* ``graphed``: the same through the captured CUDA graph (batches up to
  ``inference.cuda_graph_max_seeds``);
* ``core``: one micro-batch of B ids through ``EngineCore.add`` + ``step()`` until its reply, i.e.
  what a request costs the engine with nothing else queued (graphs on, as served);
* ``kernels``: CUDA kernels one eager forward launches (torch.profiler), at the smallest B.

It also times the engine's per-micro-batch host work (forming a batch from M micro-batches and
building their replies, no model), which bounds how many small micro-batches one core can take.

Usage (from the repository root):
    python -m bench.engine.profile_engine [--config configs/bench_reddit.yaml] [--scale 0.02]
        [--batch-sizes 1 8 48 384 1536 6144] [--iters 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from loadtest.results import add_set_option, load_config, portable
from loadtest.workloads import hot_set

if TYPE_CHECKING:
    from quiver_serve.engine.core.core import EngineCore

T = TypeVar("T")


def timed(fn: Callable[[], T], dev: torch.device, iters: int) -> tuple[float, T]:
    """Median seconds of ``fn()`` with a device sync before and after; the last result."""
    times: list[float] = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def count_kernels(fn: Callable[[], object]) -> int | None:
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def stage_row(core: EngineCore, seeds: torch.Tensor, iters: int) -> dict:
    dev, b = core.device, int(seeds.numel())
    timings = []
    for sampler in filter(None, (core.local_sampler, core.gpu_sampler)):
        sample_s, sb = timed(lambda s=sampler: s.sample(seeds, core.fanouts, 7), dev, iters)
        timings.append((sample_s, sampler.name, sb))
    sample_s, name, sb = min(timings, key=lambda t: t[0])

    def eager() -> torch.Tensor:
        n_id = sb.n_id.to(dev)
        x = core.features.gather(n_id)
        out = core.model(x, n_id, sb.edge_index.to(dev, torch.int64), sb.num_sampled_nodes,
                         sb.num_sampled_edges, False)
        return out.index_select(0, sb.seed_index.to(dev)).float()

    row: dict[str, Any] = {"batch_seeds": b, "sampled_nodes": sb.num_nodes,
                           "sampled_edges": sb.num_edges, "sampler": name,
                           "sample_ms": sample_s * 1e3,
                           "eager_ms": timed(eager, dev, iters)[0] * 1e3}
    fits = core.graphed is not None and b <= core.graphed.max_seeds
    row["graphed_ms"] = timed(lambda: core.graphed.run(sb), dev, iters)[0] * 1e3 if fits else None
    row["core_ms"] = core_latency(core, seeds.numpy(), iters) * 1e3
    return row


def core_latency(core: EngineCore, ids: np.ndarray, iters: int) -> float:
    """One micro-batch through add + step() until its reply; median seconds."""
    from quiver_serve.engine.core.micro_batch import MicroBatch
    from quiver_serve.wire import NO_SEED

    times = []
    for i in range(iters):
        m = MicroBatch(b"", i, False, NO_SEED, ids, np.array([ids.size], np.int64),
                       np.array([time.time() + 30.0]))
        t0 = time.perf_counter()
        core.add(m)
        replies: list = []
        while not replies:
            replies = core.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def host_overhead(core: EngineCore, total_ids: int, parts: list[int], iters: int) -> list[dict]:
    """Host time to form one batch of ``total_ids`` from M micro-batches and build M replies."""
    from quiver_serve.engine.core.micro_batch import MicroBatch
    from quiver_serve.sampling.base import SamplerOutput
    from quiver_serve.wire import NO_SEED, encode

    out = []
    for m in parts:
        k = max(total_ids // m, 1)
        times = []
        for _ in range(iters):
            for i in range(m):
                mb = MicroBatch(b"c", i, False, NO_SEED, np.arange(k, dtype=np.int64) % 100,
                                np.array([k], np.int64), np.array([time.time() + 30.0]))
                core.add(mb)
            t0 = time.perf_counter()
            batch, _ = core.form(time.time())
            n = int(batch.seeds.numel())
            batch.sampled = SamplerOutput(torch.zeros(n, dtype=torch.int64),
                                          torch.zeros(2, 1, dtype=torch.int64),
                                          torch.arange(n), [n, 0, 0], [1, 0])
            for r in core.answer(batch, np.zeros((n, 64), np.float32), 0.0):
                encode(r.done)
            times.append(time.perf_counter() - t0)
        out.append({"micro_batches": m, "ids": k * m, "host_ms": float(np.median(times)) * 1e3})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bench_reddit.yaml")
    ap.add_argument("--scale", type=float, help="override graph.synthetic_scale")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 16, 48, 384, 1536, 6144])
    ap.add_argument("--workload", choices=["a", "b"], default="a", help="hot set (a) or uniform (b)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", help="JSON file")
    ap.add_argument("--cprofile", type=int, default=0, metavar="SEEDS",
                    help="also print the host functions that cost most in the core path at SEEDS")
    add_set_option(ap)
    args = ap.parse_args()
    from quiver_serve.engine.core.build import build_core
    from quiver_serve.graph.datasets import load_graph

    cfg = load_config(args.config, args.sets)
    if args.scale is not None:
        cfg.graph.synthetic_scale = args.scale
    graph = load_graph(cfg.graph)
    t0 = time.perf_counter()
    core = build_core(cfg, graph, 0, None)
    print(f"{graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; core on "
          f"{core.device} in {time.perf_counter() - t0:.1f} s; graphs up to "
          f"{core.graphed.max_seeds if core.graphed else 0} seeds", flush=True)
    hot = hot_set(graph.degree().numpy())
    rng = np.random.default_rng(0)
    rows = []
    print("| seeds | sampled nodes | sampler | sample ms | eager ms | graphed ms | core ms |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch_sizes:
        pick = hot[rng.integers(0, hot.size, b)] if args.workload == "a" else \
            rng.integers(0, graph.num_nodes, b)
        r = stage_row(core, torch.from_numpy(np.asarray(pick, np.int64)), args.iters)
        rows.append(r)
        g = "-" if r["graphed_ms"] is None else f"{r['graphed_ms']:.3f}"
        print(f"| {b} | {r['sampled_nodes']:,} | {r['sampler']} | {r['sample_ms']:.3f} | "
              f"{r['eager_ms']:.3f} | {g} | {r['core_ms']:.3f} |", flush=True)
    small = core.local_sampler.sample(torch.from_numpy(hot[:1]), core.fanouts, 1)
    dev = core.device
    kernels = count_kernels(lambda: core.model(
        core.features.gather(small.n_id.to(dev)), small.n_id.to(dev),
        small.edge_index.to(dev, torch.int64), small.num_sampled_nodes, small.num_sampled_edges,
        False))
    host = host_overhead(core, 6144, [1, 16, 128], max(args.iters // 3, 5))
    print(f"\nkernels per eager forward at 1 seed: {kernels}")
    for h in host:
        print(f"host work to form + answer {h['ids']} ids in {h['micro_batches']} micro-batches: "
              f"{h['host_ms']:.3f} ms")
    if args.cprofile:
        import cProfile
        import pstats

        ids = hot[:args.cprofile].copy()
        prof = cProfile.Profile()
        prof.runcall(core_latency, core, ids, 300)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": portable(args.config), "device": str(dev),
                                              "rows": rows, "kernels_1_seed": kernels,
                                              "host": host}, indent=1) + "\n")


if __name__ == "__main__":
    main()
