#!/usr/bin/env python
"""Engine core driven directly vs the daemon through its queue API, in one run (DESIGN §6).

Same graph, model and batch sizes. The daemon's load comes from other processes, each with its own
fast-path client (``connect(pipeline.endpoints())``) and closed-loop asyncio callers, so the load
generator is not the bottleneck (its CPU use is reported). Workloads: (a) 48 ids from a 1,500-node
hot set, half lowest and half highest in-degree; (b) 48 ids uniform; (c) 1 id uniform.

    python bench/bench_engine_vs_daemon.py --config configs/bench_reddit.yaml --workloads a b c
    python bench/bench_engine_vs_daemon.py --config configs/default.yaml --cpu-targets
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quiver_serve.config import ServeConfig  # noqa: E402
from quiver_serve.engine.observer import PipelineObserver  # noqa: E402

IDS = {"a": 48, "b": 48, "c": 1}


def workload_ids(name: str, degree: np.ndarray, rng: np.random.Generator, n_requests: int) -> np.ndarray:
    """[n_requests, ids] node ids of one workload."""
    k = IDS[name]
    if name == "a":
        order = np.argsort(degree, kind="stable")
        hot = np.concatenate([order[:750], order[-750:]])
        return hot[rng.integers(0, hot.size, (n_requests, k))]
    return rng.integers(0, degree.size, (n_requests, k))


def pct(lat: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(lat), q) * 1e3) if len(lat) else float("nan")


# ---- engine core driven directly ----------------------------------------------------------------
def bench_engine(cfg: ServeConfig, graph, workload: str, batch_sizes: list[int], seconds: float) -> list[dict]:
    from quiver_serve.engine.core import MicroBatch
    from quiver_serve.engine.core_proc import build_core
    from quiver_serve.wire import NO_SEED

    core = build_core(cfg, graph, 0, None)
    degree = graph.degree().numpy()
    rng = np.random.default_rng(1)
    rows = []
    for b in batch_sizes:
        n_req = max(1, b // IDS[workload])
        lat, seeds, end, seq = [], 0, time.monotonic() + seconds, 0
        while time.monotonic() < end or len(lat) < 5:
            ids = workload_ids(workload, degree, rng, n_req)
            t0 = time.perf_counter()
            for r in range(n_req):  # one micro-batch per request: the engine merges them
                seq += 1
                core.add(MicroBatch(b"", seq, False, NO_SEED, ids[r], np.array([ids.shape[1]]),
                                    np.array([time.time() + 30.0])))
            got = 0
            while got < n_req:
                got += len(core.step())
            lat.append(time.perf_counter() - t0)
            seeds += ids.size
        total = sum(lat)
        rows.append({"workload": workload, "batch_seeds": n_req * IDS[workload],
                     "seeds_per_s": seeds / total, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)})
        print(f"engine  {workload} batch {rows[-1]['batch_seeds']:6d}: {rows[-1]['seeds_per_s']:10.0f} "
              f"seeds/s  p50 {rows[-1]['p50_ms']:.2f} p99 {rows[-1]['p99_ms']:.2f} ms", flush=True)
    del core
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# ---- the daemon, loaded from other processes -----------------------------------------------------
class _BatchSizes(PipelineObserver):
    def __init__(self) -> None:
        self.seeds = self.batches = self.sampled = 0
        self.compute_s = self.sample_s = 0.0

    def on_batch(self, stats) -> None:  # type: ignore[no-untyped-def]
        self.seeds += stats.num_seeds
        self.batches += 1
        self.sampled += stats.num_sampled_nodes
        self.compute_s += stats.compute_s
        self.sample_s += stats.sample_s


def _load_proc(endpoints, workload: str, degree: np.ndarray, callers: int, warm_s: float,
               seconds: float, seed: int, out) -> None:  # type: ignore[no-untyped-def]
    from quiver_serve.engine.pipeline import connect

    obs = _BatchSizes()
    client = connect(endpoints, obs)
    rng = np.random.default_rng(seed)
    pool = workload_ids(workload, degree, rng, 20000)
    lat: list[float] = []
    status: dict[str, int] = {}

    async def caller(i: int, start: float, end: float) -> None:
        j = i
        while time.monotonic() < end:
            j = (j + 7919) % len(pool)
            t0 = time.perf_counter()
            res = await client.submit_async(pool[j])
            if time.monotonic() >= start:
                lat.append(time.perf_counter() - t0)
                key = "200" if res.ok else str(res.error.status)
                status[key] = status.get(key, 0) + 1

    async def main() -> None:
        now = time.monotonic()
        await asyncio.gather(*[caller(i, now + warm_s, now + warm_s + seconds) for i in range(callers)])

    cpu0 = time.process_time()
    asyncio.run(main())
    cpu_s = time.process_time() - cpu0
    out.put({"lat": lat, "status": status, "cpu_frac": cpu_s / (warm_s + seconds),
             "batch_seeds": obs.seeds, "batches": obs.batches, "sampled": obs.sampled,
             "compute_s": obs.compute_s, "sample_s": obs.sample_s})
    client.stop()


def bench_daemon_point(p, workload: str, degree: np.ndarray, callers: int, procs: int,
                       seconds: float) -> dict:  # type: ignore[no-untyped-def]
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = max(1, min(procs, callers))
    share = [callers // procs + (1 if i < callers % procs else 0) for i in range(procs)]
    ps = [ctx.Process(target=_load_proc, args=(p.endpoints(), workload, degree, c, 1.5, seconds,
                                               100 + i, out)) for i, c in enumerate(share)]
    for pr in ps:
        pr.start()
    parts = [out.get(timeout=seconds + 120) for _ in ps]
    for pr in ps:
        pr.join(timeout=10)
    lat = [x for part in parts for x in part["lat"]]
    status: dict[str, int] = {}
    for part in parts:
        for k, v in part["status"].items():
            status[k] = status.get(k, 0) + v
    ok = status.get("200", 0)
    batches = sum(part["batches"] for part in parts)
    row = {"workload": workload, "callers": callers, "load_procs": procs,
           "seeds_per_s": ok * IDS[workload] / seconds, "req_per_s": ok / seconds,
           "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99), "status": status,
           "mean_batch_seeds": sum(part["batch_seeds"] for part in parts) / max(batches, 1),
           "load_cpu_frac_per_proc": [round(part["cpu_frac"], 2) for part in parts],
           "mean_sampled_nodes": sum(part["sampled"] for part in parts) / max(batches, 1),
           "mean_compute_ms": 1e3 * sum(part["compute_s"] for part in parts) / max(batches, 1),
           "mean_sample_ms": 1e3 * sum(part["sample_s"] for part in parts) / max(batches, 1)}
    print(f"daemon  {workload} callers {callers:5d}: {row['seeds_per_s']:10.0f} seeds/s  p50 "
          f"{row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms  batch {row['mean_batch_seeds']:.0f} "
          f"(sampled {row['mean_sampled_nodes']:.0f}, sample {row['mean_sample_ms']:.2f} ms, "
          f"model {row['mean_compute_ms']:.2f} ms)  "
          f"status {status}  load cpu {row['load_cpu_frac_per_proc']}", flush=True)
    return row


def summarise(engine: list[dict], daemon: list[dict], p99_ms: float) -> list[dict]:
    out = []
    for w in sorted({r["workload"] for r in daemon}):
        ok = [r for r in daemon if r["workload"] == w and r["p99_ms"] <= p99_ms
              and set(r["status"]) == {"200"}]
        best = max(ok, key=lambda r: r["seeds_per_s"]) if ok else None
        eng = [r for r in engine if r["workload"] == w]
        ref = min(eng, key=lambda r: abs(r["batch_seeds"] - best["mean_batch_seeds"])) if best and eng else None
        out.append({"workload": w, "daemon": best, "engine_at_same_batch": ref,
                    "efficiency": best["seeds_per_s"] / ref["seeds_per_s"] if best and ref else None})
    return out


def print_table(summary: list[dict], p99_ms: float) -> None:
    print(f"\n| workload | daemon seeds/s (p99 <= {p99_ms:g} ms) | p50 / p99 ms | mean batch | "
          "engine seeds/s at that batch | engine p50 / p99 ms | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        d, e = s["daemon"], s["engine_at_same_batch"]
        if d is None:
            print(f"| {s['workload']} | none under the bound | | | | | |")
            continue
        eng = f"{e['seeds_per_s']:,.0f} (batch {e['batch_seeds']}) | {e['p50_ms']:.2f} / {e['p99_ms']:.2f}" if e else "| "
        eff = f"{s['efficiency']:.2f}" if s["efficiency"] else ""
        print(f"| {s['workload']} | {d['seeds_per_s']:,.0f} ({d['callers']} callers) | "
              f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f} | {d['mean_batch_seeds']:.0f} | {eng} | {eff} |")


def cpu_targets(p, degree: np.ndarray, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    """The CPU-box targets through Pipeline.embed: 64 callers x 48 ids vs 2 callers x 4,096 ids,
    and single-id latency with one caller (all callers in this process's threads)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)

    def run(callers: int, k: int) -> tuple[float, list[float]]:
        lat: list[float] = []
        end = time.monotonic() + seconds

        def one(i: int) -> int:
            n = 0
            local = np.random.default_rng(i)
            while time.monotonic() < end:
                ids = local.integers(0, degree.size, k)
                t0 = time.perf_counter()
                p.embed(ids)
                lat.append(time.perf_counter() - t0)
                n += k
            return n

        with ThreadPoolExecutor(callers) as ex:
            total = sum(ex.map(one, range(callers)))
        return total / seconds, lat

    p.embed(rng.integers(0, degree.size, 48))
    small, _ = run(64, 48)
    big, _ = run(2, 4096)
    _, single = run(1, 1)
    row = {"seeds_per_s_64x48": small, "seeds_per_s_2x4096": big, "efficiency": small / big,
           "single_id_p50_ms": pct(single, 50), "single_id_p99_ms": pct(single, 99)}
    print(json.dumps(row, indent=1))
    return row


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bench_reddit.yaml")
    ap.add_argument("--scale", type=float, help="override graph.synthetic_scale")
    ap.add_argument("--workloads", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--callers", nargs="+", type=int, default=[16, 64, 256, 1024])
    ap.add_argument("--callers-c", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[48, 768, 3072, 8192])
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--p99-ms", type=float, default=10.0)
    ap.add_argument("--cpu-targets", action="store_true", help="the CPU-box targets instead")
    ap.add_argument("--out", help="JSON results file")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from quiver_serve.config import resolve_path
    from quiver_serve.engine.pipeline import Pipeline
    from quiver_serve.graph.datasets import load_graph

    cfg = ServeConfig.from_yaml(resolve_path(args.config))
    if args.scale is not None:
        cfg.graph.synthetic_scale = args.scale
    graph = load_graph(cfg.graph)
    graph.share_memory_()
    degree = graph.degree().numpy()
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(), "graph": graph.describe(), "args": vars(args)}
    print(meta, flush=True)
    result: dict = {"meta": meta}
    if args.cpu_targets:
        p = Pipeline(cfg, graph=graph).start()
        try:
            result["cpu_targets"] = cpu_targets(p, degree, args.seconds)
        finally:
            p.stop()
    else:
        engine = []
        for w in args.workloads:
            sizes = args.batch_sizes if w != "c" else [1, 16, 64, 256]
            engine += bench_engine(cfg, graph, w, sizes, args.seconds)
        daemon = []
        p = Pipeline(cfg, graph=graph).start()
        try:
            for w in args.workloads:
                for c in args.callers if w != "c" else args.callers_c:
                    daemon.append(bench_daemon_point(p, w, degree, c, args.procs, args.seconds))
        finally:
            p.stop()
        result.update(engine=engine, daemon=daemon, summary=summarise(engine, daemon, args.p99_ms))
        print_table(result["summary"], args.p99_ms)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
