"""GPU sampler benchmark: CUDA (CSC in GPU memory) and UVA (CSC pinned in host memory) against
the C++ CPU sampler on 16 threads and on 1 thread, in the same run, same seed batches.

Per (graph, implementation, batch size): p50/p99 latency of one ``sample()`` call, end to end (CPU
seed tensor in, outputs ready on the device; the sampler's own final synchronisation is inside
the timed region), and sampled edges/s (sum of ``num_sampled_edges`` over the total time).
Every repeat uses a fresh random seed batch and batch seed, so the caches see new nodes.

Graphs:
* ``reddit``: a SYNTHETIC power-law graph of Reddit's size (232,965 nodes, ~114.6 M directed edges),
  built by this script's own vectorised generator (below, on the GPU when there is one), not the
  real Reddit graph and not quiver_serve.graph.synthetic (which takes the pydantic config).
* ``tolokers``: the real Tolokers graph from the heterophilous-graphs ``.npz``, made undirected as
  PyG's ``HeterophilousGraphDataset`` does.

    python -m bench.sampling.gpu_sampler                # everything, ~3 min on an H200 box
    python -m bench.sampling.gpu_sampler --quick        # fewer repeats, reddit only

JSON with ``--json FILE``, or by default when ``$OUT`` is set:
``$OUT/gpu_sampler_<machine>_<date>[_<variant>].json`` (``loadtest/results.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from loadtest.results import add_result_options, result_path, run_meta, write_result
from quiver_serve.graph.csc import GraphData
from quiver_serve.sampling.gpu import CudaSampler, UvaSampler, gpu_sampler_available

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where tolokers.npz is looked for unless --tolokers names it: a git-ignored copy in the
# repository, then the shared data folder beside the checkout.
TOLOKERS_PATHS = (
    REPO_ROOT / ".devdata" / "tolokers.npz",
    REPO_ROOT.parent / "shared" / "data" / "heterophilous" / "tolokers.npz",
)
REDDIT_NODES, REDDIT_EDGES = 232_965, 114_615_892
FANOUTS = [25, 10]
BATCH_SIZES = [1, 16, 128, 1024, 8192]
CPU_CELL_BUDGET_S = 3.0  # wall time per CPU cell; a 1-thread 8192 batch takes ~0.1-1 s


# ---- graphs ---------------------------------------------------------------------------------------


def power_law_csc(num_nodes: int, num_edges: int, device: torch.device, seed: int = 0) -> GraphData:
    """Synthetic power-law graph as a CSC on the CPU (generated on ``device``).

    In-degrees: Pareto tail exponent 2.5, capped at 50x the mean (Reddit's largest degree is
    about 44x its mean), stochastically rounded to the target total. Sources: drawn independently
    with Pareto weights (a heavy out-degree tail). Duplicate (source, target) pairs are removed
    after oversampling by the measured duplicate share, so the result is a simple graph whose
    edge count is close to, not exactly, ``num_edges``.
    """
    gen = torch.Generator(device).manual_seed(seed)
    mean_degree = num_edges / num_nodes
    raw = torch.rand(num_nodes, generator=gen, device=device, dtype=torch.float64).pow(-1 / 1.5)
    src_weight = torch.rand(num_nodes, generator=gen, device=device, dtype=torch.float64).pow(
        -1 / 1.5
    )
    src_cdf = torch.cumsum(src_weight, 0)
    src_cdf /= src_cdf[-1].clone()
    target = float(num_edges)
    for _attempt in range(2):  # second pass compensates for the duplicates removed
        degree = raw * (target / raw.sum())
        degree = degree.clamp(max=min(50 * mean_degree, num_nodes - 1))
        degree = degree * (target / degree.sum())
        degree = (
            (degree + torch.rand(num_nodes, generator=gen, device=device, dtype=torch.float64))
            .floor()
            .long()
        )
        degree.clamp_(max=num_nodes - 1)
        dst = torch.repeat_interleave(torch.arange(num_nodes, device=device), degree)
        u = torch.rand(dst.numel(), generator=gen, device=device, dtype=torch.float64)
        src = torch.searchsorted(src_cdf, u).clamp_(max=num_nodes - 1)
        del u
        keys = torch.unique(dst * num_nodes + src)  # sorted: by target, then source
        del dst, src
        if keys.numel() >= 0.998 * num_edges:
            break
        target *= num_edges / keys.numel()
    dst, src = keys // num_nodes, keys % num_nodes
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0, out=indptr[1:])
    return GraphData("reddit-synthetic", indptr.cpu(), src.cpu(), torch.zeros(num_nodes, 1))


def tolokers_csc(path: Path | None = None) -> GraphData:
    from torch_geometric.utils import to_undirected

    path = path or next((p for p in TOLOKERS_PATHS if p.exists()), None)
    if path is None:
        raise FileNotFoundError(f"tolokers.npz not found in {[str(p) for p in TOLOKERS_PATHS]}; "
                                f"name it with --tolokers")
    archive = np.load(path)
    x = torch.from_numpy(archive["node_features"])
    edge_index = to_undirected(
        torch.from_numpy(archive["edges"]).t().contiguous(), num_nodes=x.size(0)
    )
    return GraphData.from_edge_index(edge_index, x, name="tolokers")


# ---- timing ---------------------------------------------------------------------------------------


@dataclass
class Cell:
    graph: str
    impl: str  # cuda | uva | cpp16 | cpp1
    batch: int
    repeats: int
    p50_ms: float
    p99_ms: float
    edges_per_s: float
    nodes_per_batch: float


def seed_batches(num_nodes: int, batch: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` random seed batches (CPU int64), rotated through so no batch repeats back to back."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, num_nodes, (batch,), generator=gen) for _ in range(count)]


def time_cell(
    sampler, batches: list[torch.Tensor], repeats: int, warmup: int, budget_s: float
) -> dict:
    """Median and p99 of per-call wall time; stops early after ``budget_s`` of timed calls."""
    for i in range(warmup):
        sampler.sample(batches[i % len(batches)], FANOUTS, seed=10_000 + i)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    latencies_s, edges, nodes = [], 0, 0
    started = time.perf_counter()
    for i in range(repeats):
        seeds = batches[i % len(batches)]
        t0 = time.perf_counter()
        out = sampler.sample(seeds, FANOUTS, seed=i)  # returns after its own device sync
        latencies_s.append(time.perf_counter() - t0)
        edges += sum(out.num_sampled_edges)
        nodes += out.num_nodes
        if time.perf_counter() - started > budget_s and i >= 4:
            break
    lat = np.array(latencies_s)
    return dict(
        repeats=len(lat),
        p50_ms=float(np.median(lat) * 1e3),
        p99_ms=float(np.percentile(lat, 99) * 1e3),
        edges_per_s=edges / float(lat.sum()),
        nodes_per_batch=nodes / len(lat),
    )


def gpu_repeats(batch: int, quick: bool) -> int:
    repeats = 400 if batch <= 128 else 150 if batch <= 1024 else 60
    return max(20, repeats // 4) if quick else repeats


def make_cpp_sampler(graph: GraphData):
    """The colleague's C++ sampler, or (None, reason) when it cannot be imported or built here."""
    try:
        from quiver_serve.sampling.cpu import CppSampler, cpp_sampler_available, cpu_sampler_status
    except Exception as exc:  # missing module or a dependency of it
        return None, f"import failed: {type(exc).__name__}: {exc}"
    if not cpp_sampler_available():
        return None, cpu_sampler_status()
    return CppSampler(graph.indptr, graph.indices), "ok"


def bench_graph(
    graph: GraphData, batch_sizes: list[int], quick: bool, notes: list[str]
) -> list[Cell]:
    cells: list[Cell] = []
    samplers = {
        "cuda": CudaSampler(graph.indptr, graph.indices, device=0),
        "uva": UvaSampler(graph.indptr, graph.indices, device=0),
    }
    cpp, why = make_cpp_sampler(graph)
    if cpp is None:
        notes.append(f"C++ sampler skipped on {graph.name}: {why}")
    for batch in batch_sizes:
        batches = seed_batches(graph.num_nodes, batch, 64, seed=batch)
        for impl, sampler in samplers.items():
            stats = time_cell(sampler, batches, gpu_repeats(batch, quick), warmup=20, budget_s=20.0)
            cells.append(Cell(graph.name, impl, batch, **stats))
        for threads in (16, 1) if cpp is not None else ():
            torch.set_num_threads(threads)
            stats = time_cell(
                cpp, batches, 200, warmup=2, budget_s=CPU_CELL_BUDGET_S / (1 if quick else 1)
            )
            cells.append(Cell(graph.name, f"cpp{threads}", batch, **stats))
        torch.set_num_threads(16)
        print(
            f"  {graph.name} batch {batch}: "
            + ", ".join(
                f"{c.impl} {c.p50_ms:.3f} ms"
                for c in cells
                if c.batch == batch and c.graph == graph.name
            ),
            flush=True,
        )
    samplers["uva"].close()
    return cells


def sweep_items_per_block(graph: GraphData, quick: bool) -> list[tuple[int, int, float]]:
    """p50 of the cuda sampler per grid-sizing setting (edges of bound work per block)."""
    sampler = CudaSampler(graph.indptr, graph.indices, device=0)
    rows = []
    for batch in (128, 1024):
        batches = seed_batches(graph.num_nodes, batch, 64, seed=7 + batch)
        for items in (256, 1024, 2048, 8192):
            sampler.items_per_block = items
            stats = time_cell(sampler, batches, 50 if quick else 150, warmup=10, budget_s=10.0)
            rows.append((batch, items, stats["p50_ms"]))
    return rows


# ---- report ---------------------------------------------------------------------------------------


def summary(cells: list[Cell], sweep: list[tuple[int, int, float]], notes: list[str]) -> str:
    by = {(c.graph, c.impl, c.batch): c for c in cells}
    lines = [f"== sampler latency per batch, fanouts {FANOUTS} (p50/p99 ms, M sampled edges/s) =="]
    lines.append(
        f"{'graph':18} {'batch':>6} "
        + " ".join(f"{impl:>24}" for impl in ("cuda", "uva", "cpp16", "cpp1"))
    )
    for graph in dict.fromkeys(c.graph for c in cells):
        for batch in dict.fromkeys(c.batch for c in cells if c.graph == graph):
            row = []
            for impl in ("cuda", "uva", "cpp16", "cpp1"):
                c = by.get((graph, impl, batch))
                row.append(
                    f"{c.p50_ms:8.3f}/{c.p99_ms:8.3f} {c.edges_per_s / 1e6:6.0f}"
                    if c
                    else f"{'-':>24}"
                )
            lines.append(f"{graph:18} {batch:>6} " + " ".join(row))
    lines.append("== ratios: cuda speed-up over cpp16 (p50 latency), uva/cuda (p50) ==")
    for (graph, impl, batch), c in by.items():
        if impl != "cuda":
            continue
        uva, cpp = by.get((graph, "uva", batch)), by.get((graph, "cpp16", batch))
        speedup = f"{cpp.p50_ms / c.p50_ms:7.1f}x" if cpp else "    n/a"
        lines.append(
            f"{graph:18} {batch:>6}  cuda/cpp16 {speedup}  uva/cuda {uva.p50_ms / c.p50_ms:5.2f}"
        )
    lines.extend(targets(by))
    if sweep:
        lines.append("== grid sizing sweep (cuda, first graph): batch, items_per_block, p50 ms ==")
        lines.append("  ".join(f"{b}/{i}:{p:.3f}" for b, i, p in sweep))
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def targets(by: dict) -> list[str]:
    """The GPU sampler's targets, met or missed, on the first graph (the Reddit-scale one)."""
    graph = next(iter(by))[0]
    out = ["== targets (" + graph + ") =="]
    one = by.get((graph, "cuda", 1))
    if one:
        out.append(
            f"1-node batch p50 {one.p50_ms:.3f} ms (target <= 0.2): {_verdict(one.p50_ms <= 0.2)}"
        )
    cuda, cpp = by.get((graph, "cuda", 1024)), by.get((graph, "cpp16", 1024))
    if cuda and cpp:
        ratio = cpp.p50_ms / cuda.p50_ms
        out.append(
            f"cuda vs cpp16 at batch 1024: {ratio:.1f}x (target >= 30x): {_verdict(ratio >= 30)}"
        )
    for (g, impl, batch), uva in by.items():
        cuda = by.get((g, "cuda", batch))
        if g == graph and impl == "uva" and cuda:
            ratio = uva.p50_ms / cuda.p50_ms
            out.append(
                f"uva/cuda at batch {batch}: {ratio:.2f} (target <= 2): {_verdict(ratio <= 2)}"
            )
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--graphs", default="reddit,tolokers")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--sweep", action="store_true", help="also time grid sizes (items_per_block)"
    )
    parser.add_argument(
        "--tolokers", type=Path, default=None,
        help="tolokers.npz (default: .devdata/tolokers.npz in the repository, else "
        "../shared/data/heterophilous/tolokers.npz beside it)",
    )
    parser.add_argument("--json", help="JSON file (default: $OUT/gpu_sampler_<machine>_<date>"
                        "[_<variant>].json when OUT is set, else none)")
    add_result_options(parser)
    args = parser.parse_args()
    if not args.json and os.environ.get("OUT"):
        args.json = str(result_path("gpu_sampler", args))
    if not gpu_sampler_available():
        sys.exit("no CUDA device or no CuPy: nothing to benchmark")
    torch.set_num_threads(16)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cells, sweep, notes = (
        [],
        [],
        [
            f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs"
        ],
    )
    for name in args.graphs.split(","):
        if name == "tolokers" and args.tolokers is None and \
                not any(p.exists() for p in TOLOKERS_PATHS):
            notes.append("tolokers: skipped (no tolokers.npz in the usual places; --tolokers PATH "
                         "names one)")
            print(notes[-1], flush=True)
            continue
        t0 = time.perf_counter()
        graph = (
            power_law_csc(REDDIT_NODES, REDDIT_EDGES, torch.device("cuda", 0))
            if name == "reddit"
            else tolokers_csc(args.tolokers)
        )
        notes.append(
            f"{graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, max in-degree "
            f"{int(graph.degree().max()):,}, built in {time.perf_counter() - t0:.1f} s"
        )
        print(notes[-1], flush=True)
        cells += bench_graph(graph, batch_sizes, args.quick, notes)
        if not sweep and args.sweep:
            sweep = sweep_items_per_block(graph, args.quick)
        del graph
        torch.cuda.empty_cache()
    report = summary(cells, sweep, notes)
    if args.json:
        write_result(args.json, {"meta": run_meta(args), "cells": [asdict(c) for c in cells],
                                 "sweep": sweep, "notes": notes})
    print(report)


if __name__ == "__main__":
    main()
