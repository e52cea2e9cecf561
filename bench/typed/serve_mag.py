"""The typed contract on the ogbn-mag-shaped synthetic graph (docs/decisions/0050-typed-gpu-core.md):
reverse relations, to_hetero(GraphSAGE) hidden 256, [25, 10] per relation, 48 uniform paper ids
per request.

1. The engine core driven directly (``add`` and ``step()`` in this process; the GPU core on a CUDA device,
   the CPU core on a CPU): per-batch p50/p99 of 48 paper ids, its seeds/s one batch at a time,
   sampled nodes and edges per seed, and the batches per node type and path.
2. The daemon's queue API (``Pipeline`` in this process, engine cores in their own): closed-loop
   coroutines (``Pipeline.embed_async``) at rising callers; seeds/s at p99 <= ``--p99-ms`` (the
   best point within it), its ratio to step 1's seeds/s, and the single-id p50 (one caller).

    python -m bench.typed.serve_mag --scale 1.0 --device cuda --out bench/results/typed_mag_h200.json
    python -m bench.typed.serve_mag --scale 0.002 --device cpu --smoke     # a CPU check
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

import numpy as np
import torch

from loadtest.driver import closed_loop
from loadtest.results import add_result_options, result_path, run_meta, write_result
from quiver_serve.config import ServeConfig

SEEDS_PER_REQUEST = 48
SEED_TYPE = "paper"


def mag_config(scale: float, device: str, hidden: int, fanouts: list[int]) -> ServeConfig:
    cfg = ServeConfig()
    g = cfg.graph
    g.format, g.synthetic_preset, g.synthetic_scale, g.add_reverse_edges = \
        "synthetic", "mag", scale, True
    m = cfg.model
    m.name, m.pyg_class, m.weights = "mag-typed-sage", "GraphSAGE", None
    m.kwargs = {"hidden_channels": hidden, "num_layers": len(fanouts), "out_channels": hidden}
    m.to_hetero = {"aggr": "sum"}
    cfg.sampling.fanouts = list(fanouts)
    cfg.inference.device = device
    cfg.exact.materialize = "off"
    cfg.sampling.num_cpu_workers = 0  # typed engine cores sample in themselves
    cfg.server.start_timeout_s = 1800.0
    return cfg


def percentiles_ms(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s) or [0.0]
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3}


def step_batch(core: Any, ids: np.ndarray) -> None:
    """One request of ``ids`` into the core (``add``) and ``step()`` until it is answered."""
    from quiver_serve.engine.core.micro_batch import MicroBatch
    from quiver_serve.wire import NO_SEED

    mb = MicroBatch(b"bench", 0, False, NO_SEED, ids.astype(np.int64),
                    np.array([ids.size], np.int64), np.array([time.time() + 60.0]))
    mb.node_type = SEED_TYPE
    refused = core.add(mb)
    if refused is not None:
        raise RuntimeError(f"the engine core refused the batch: {refused.done.errors}")
    replies: list = []
    while not replies:
        replies = core.step()
    if replies[0].done.errors:
        raise RuntimeError(f"the engine core failed the batch: {replies[0].done.errors}")


def batch_sizes(core: Any, sizes: list[int], batches: int, gen: torch.Generator) -> list[dict]:
    """Per-batch time through the GPU path at each batch size (seeds): sampling, and the
    rest (features, model, copy back), from the core's own per-batch stats."""
    from quiver_serve.routing.router import Route

    count = core.graph.num_nodes[SEED_TYPE]
    route = Route.GPU if getattr(core, "gpu_sampler", None) is not None else Route.LOCAL
    out = []
    for size in sizes:
        samples, computes, walls = [], [], []
        for i in range(batches + 2):
            ids = torch.randint(0, count, (size,), generator=gen)
            before = core.type_stats.get((SEED_TYPE, str(route)))
            s0, c0 = (before.sample_s, before.compute_s) if before else (0.0, 0.0)
            t = time.perf_counter()
            core.rows_on(route, SEED_TYPE, ids, False, i)
            wall = time.perf_counter() - t
            now = core.type_stats[(SEED_TYPE, str(route))]
            if i >= 2:
                walls.append(wall)
                samples.append(now.sample_s - s0)
                computes.append(now.compute_s - c0)
        point = {"seeds": size, **percentiles_ms(walls),
                 "sample_p50_ms": statistics.median(samples) * 1e3,
                 "compute_p50_ms": statistics.median(computes) * 1e3,
                 "seeds_per_s": size * len(walls) / sum(walls)}
        print(f"  batch of {size}: p50 {point['p50_ms']:.2f} ms (sample "
              f"{point['sample_p50_ms']:.2f}, rest {point['compute_p50_ms']:.2f}), "
              f"{point['seeds_per_s']:.0f} seeds/s", flush=True)
        out.append(point)
    return out


def profile_batch(core: Any, size: int, gen: torch.Generator) -> dict[str, list[dict]]:
    """Where one batch of ``size`` seeds through the GPU path spends its time (torch's
    profiler, five batches): the whole batch and the GPU sampler alone, each op by self CPU
    time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from quiver_serve.routing.router import Route

    ids = torch.randint(0, core.graph.num_nodes[SEED_TYPE], (size,), generator=gen)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    runs = {"batch": lambda i: core.rows_on(Route.GPU, SEED_TYPE, ids, False, i),
            "sampler": lambda i: core.gpu_sampler.sample(SEED_TYPE, ids, core.fanouts, i)}
    out = {}
    for name, run in runs.items():
        with profile(activities=activities) as prof:
            for i in range(5):
                run(i)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        events = prof.key_averages()
        for key, attr in (("cpu", "self_cpu_time_total"), ("device", "self_device_time_total")):
            top = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:20]
            out[f"{name}_by_{key}"] = [
                {"op": e.key, "calls": e.count / 5, "self_cpu_us": round(e.self_cpu_time_total / 5, 1),
                 "device_us": round(getattr(e, "self_device_time_total", 0.0) / 5, 1)}
                for e in top]
    return out


def drive_core(cfg: ServeConfig, batches: int, gen: torch.Generator,
               sizes: list[int] | None = None, profile_sizes: list[int] | None = None
               ) -> dict[str, Any]:
    """Step 1 of the module docstring."""
    from quiver_serve.engine.core.typed_core import build_typed_core
    from quiver_serve.graph.typed_load import load_typed_graph

    graph = load_typed_graph(cfg.graph)
    t0 = time.perf_counter()
    if cfg.inference.device == "cuda":
        from quiver_serve.engine.core.typed_gpu import build_typed_gpu_core

        core = build_typed_gpu_core(cfg, graph)
    else:
        core = build_typed_core(cfg, graph)
    build_s = time.perf_counter() - t0
    count = graph.num_nodes[SEED_TYPE]
    times, nodes, edges = [], 0, 0
    for i in range(batches):
        ids = torch.randint(0, count, (SEEDS_PER_REQUEST,), generator=gen)
        t = time.perf_counter()
        step_batch(core, ids.numpy())
        times.append(time.perf_counter() - t)
        if i < 20:
            out = core.sampler.sample(SEED_TYPE, ids, core.fanouts, i)
            nodes, edges = nodes + out.num_nodes, edges + out.num_edges
    sampled = min(batches, 20) * SEEDS_PER_REQUEST
    result = {"graph": graph.describe(), "num_papers": count, "build_s": round(build_s, 2), "batches": batches,
              **percentiles_ms(times),
              "seeds_per_s": SEEDS_PER_REQUEST * len(times) / sum(times),
              "sampled_nodes_per_seed": nodes / sampled, "sampled_edges_per_seed": edges / sampled}
    if hasattr(core, "stats_by_type"):
        result["by_type"] = core.stats_by_type()
        result["features"] = core.features.describe()
        result["samplers"] = sampler_times(core, graph, min(batches, 100), gen)
        if sizes:
            result["batch_sizes"] = batch_sizes(core, sizes, min(batches, 50), gen)
        if profile_sizes and getattr(core, "gpu_sampler", None) is not None:
            result["profile"] = {str(n): profile_batch(core, n, gen) for n in profile_sizes}
    del core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def sampler_times(core: Any, graph: Any, batches: int, gen: torch.Generator) -> dict[str, Any]:
    """Per-batch sampling time of 48 paper ids: the C++ sampler, the reference's torch code on
    the core's device, and the GPU sampler's kernels (when they built); every output checked
    equal to the C++ sampler's."""
    from quiver_serve.sampling.typed_gpu import TypedGpuSampler

    samplers = {"cpp": core.sampler}
    if core.gpu_sampler is not None:
        samplers["gpu_torch"] = TypedGpuSampler(graph, core.device, "device", kernels=False)
        if getattr(core.gpu_sampler, "kernels", None) is not None:
            samplers["gpu_kernels"] = core.gpu_sampler
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    count = graph.num_nodes[SEED_TYPE]
    times: dict[str, list[float]] = {name: [] for name in samplers}
    equal = True
    for i in range(batches + 3):
        ids = torch.randint(0, count, (SEEDS_PER_REQUEST,), generator=gen)
        outs = {}
        for name, sampler in samplers.items():
            sync()
            t0 = time.perf_counter()
            outs[name] = sampler.sample(SEED_TYPE, ids, core.fanouts, i)
            sync()
            if i >= 3:  # the first batches pay one-off costs
                times[name].append(time.perf_counter() - t0)
        want = outs["cpp"]
        for out in outs.values():
            equal &= all(torch.equal(out.node[t].cpu(), want.node[t]) for t in want.node) and \
                all(torch.equal(out.edge_index[et].cpu(), want.edge_index[et])
                    for et in want.edge_index)
    return {"equal_to_cpp": bool(equal),
            **{name: percentiles_ms(t) for name, t in times.items()}}


def queue_point(pipe: Any, requests: np.ndarray, callers: int, seconds: float) -> dict[str, Any]:
    from quiver_serve.errors import ServeError

    async def call(i: int) -> str:
        try:
            await pipe.embed_async(requests[i], node_type=SEED_TYPE)
        except ServeError as exc:
            return str(exc.info.status)
        return "200"

    win0 = time.time() + 0.5
    res = asyncio.run(closed_loop(call, np.full(len(requests), requests.shape[1]), callers,
                                  win0, win0 + seconds))
    ok = int(res["status"].get("200", 0))
    return {"callers": callers, "requests": ok, **percentiles_ms(list(res["lat_s"])),
            "seeds_per_s": ok * requests.shape[1] / seconds,
            "status": {str(k): v for k, v in res["status"].items()}}


def drive_queue(cfg: ServeConfig, args: argparse.Namespace, count: int,
                workers: int = 1) -> dict[str, Any]:
    """Step 2 of the module docstring, with ``workers`` engine cores (on one GPU they share it:
    each has its own host thread launching kernels)."""
    from quiver_serve.engine.client.pipeline import Pipeline

    cfg = cfg.model_copy(deep=True)
    cfg.inference.num_workers = workers
    rng = np.random.default_rng(0)
    requests = rng.integers(0, count, (4096, SEEDS_PER_REQUEST))
    singles = rng.integers(0, count, (4096, 1))
    pipe = Pipeline(cfg).start()
    try:
        points = [queue_point(pipe, requests, c, args.seconds) for c in args.callers]
        single = queue_point(pipe, singles, 1, args.seconds)
    finally:
        pipe.stop()
    within = [p for p in points if p["p99_ms"] <= args.p99_ms and p["requests"]]
    best = max(within, key=lambda p: p["seeds_per_s"], default=None)
    return {"workers": workers, "points": points, "best_within_p99": best,
            "seeds_per_s_at_p99": best["seeds_per_s"] if best else 0.0,
            "single_id_p50_ms": single["p50_ms"], "single_id": single}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--fanouts", type=int, nargs="+", default=[25, 10])
    ap.add_argument("--batches", type=int, default=300, help="batches driven into the core")
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per point")
    ap.add_argument("--p99-ms", type=float, default=10.0)
    ap.add_argument("--gpu-cache-bytes", type=int, default=None,
                    help="inference.gpu_cache_bytes (default: the config's; below the feature "
                         "rows' size the hottest rows of every type by FAP go to the GPU)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 48, 256, 1024, 2048, 4096],
                    help="seeds per batch driven through the GPU path, one after another")
    ap.add_argument("--profile-seeds", type=int, nargs="*", default=[48],
                    help="profile a batch of each of these many seeds")
    ap.add_argument("--workers", type=int, nargs="*", default=[1],
                    help="engine cores behind the queue API, one run per value (none: the "
                         "engine core alone)")
    ap.add_argument("--smoke", action="store_true", help="a few batches and short points")
    ap.add_argument("--out", help="result file (default: results/typed_mag_<machine>_<date>.json)")
    add_result_options(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.callers, args.seconds = 5, [1, 2], 1.0
        args.batch_sizes = [1, 48]
    cfg = mag_config(args.scale, args.device, args.hidden, args.fanouts)
    if args.gpu_cache_bytes is not None:
        cfg.inference.gpu_cache_bytes = args.gpu_cache_bytes
    torch.set_num_threads(cfg.inference.torch_threads)  # as the engine process does
    core = drive_core(cfg, args.batches, torch.Generator().manual_seed(0), args.batch_sizes,
                      args.profile_seeds)
    print(f"engine core: {core['seeds_per_s']:.0f} seeds/s, p50 {core['p50_ms']:.2f} ms, "
          f"p99 {core['p99_ms']:.2f} ms, {core['sampled_nodes_per_seed']:.1f} nodes and "
          f"{core['sampled_edges_per_seed']:.1f} edges per seed", flush=True)
    queues = []
    for workers in args.workers:
        queue = drive_queue(cfg, args, core["num_papers"], workers)
        ratio = queue["seeds_per_s_at_p99"] / core["seeds_per_s"] if core["seeds_per_s"] else None
        queue["over_core"] = ratio
        print(f"queue API, {workers} engine core(s): {queue['seeds_per_s_at_p99']:.0f} seeds/s at "
              f"p99 <= {args.p99_ms} ms (ratio to one core driven directly "
              f"{ratio if ratio is None else round(ratio, 3)}), single id p50 "
              f"{queue['single_id_p50_ms']:.2f} ms", flush=True)
        queues.append(queue)
    result = {"meta": run_meta(args, cfg, scale=args.scale, seeds_per_request=SEEDS_PER_REQUEST),
              "engine_core": core, "queue_api": queues[0] if queues else None,
              "queue_over_core": queues[0]["over_core"] if queues else None,
              "queue_api_by_workers": queues}
    write_result(result_path("typed_mag", args), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
