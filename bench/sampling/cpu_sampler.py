"""CPU sampler benchmark: reference torch vs the C++ sampler vs PyG's own sampler, same run.

Per (implementation, threads, batch size) it reports p50/p99 latency per batch and sampled edges/s
(sum of ``num_sampled_edges``; for PyG the number of sampled edges it returns, the same count).
Seed batches are random distinct node ids, identical for every implementation. PyG's baseline is
``torch_geometric.sampler.NeighborSampler`` (in-neighbours, ``replace=False``, directional), which
without pyg-lib runs torch-sparse's ``neighbor_sample``; it needs the bench venv (torch-sparse
wheels; see BENCHMARKS.md) and is skipped with a note when torch_sparse is missing.

From the repository root:

    .bench_env/bin/python -m bench.sampling.cpu_sampler --graph tolokers
    .bench_env/bin/python -m bench.sampling.cpu_sampler --graph reddit --scale 0.25
    .bench_env/bin/python -m bench.sampling.cpu_sampler --memory --scale 1.0

Tolokers is read from ``--tolokers-npz`` (default: the shared data folder beside the checkout,
``../shared/data/heterophilous/tolokers.npz``). Paths recorded in ``--json`` are relative to the
repository, or bare file names when outside it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loadtest.results import portable, run_meta, write_result
from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.sampling.cpu import CppSampler, cpp_sampler_available, cpu_sampler_status
from quiver_serve.sampling.reference import ReferenceSampler

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOLOKERS_NPZ = REPO_ROOT.parent / "shared" / "data" / "heterophilous" / "tolokers.npz"
# Sampling calls per cell stop at whichever comes first: --repeats or this much wall time.
MIN_REPEATS = 5

SampleFn = Callable[[torch.Tensor], int]  # seeds -> sampled edges


@dataclass
class Row:
    impl: str
    threads: int
    batch: int
    repeats: int
    p50_ms: float
    p99_ms: float
    edges_per_batch: float
    edges_per_s: float
    other_cores_busy: float  # CPU other processes used meanwhile, in cores (shared dev box)
    ratio_vs_pyg: float | None = None


# ---- graphs ---------------------------------------------------------------------------------


def load_bench_graph(name: str, scale: float,
                     tolokers_npz: Path = DEFAULT_TOLOKERS_NPZ) -> tuple[GraphData, str]:
    """The benchmark graph and a note on how it was made."""
    if name == "tolokers":
        try:
            from quiver_serve.graph.datasets import load_npz
        except ImportError:
            note = "tolokers.npz made undirected inline (no load_npz yet)"
            return _tolokers_inline(tolokers_npz), note
        return load_npz(tolokers_npz, "tolokers"), "tolokers via quiver_serve load_npz"
    try:
        from quiver_serve.graph.synthetic import generate_synthetic
    except ImportError:
        return _power_law_inline(scale), "inline power-law graph (quiver_serve.graph.synthetic missing)"
    cfg = GraphConfig(format="synthetic", synthetic_preset="reddit", synthetic_scale=scale, path=None)
    return generate_synthetic(cfg), f"synthetic reddit preset, scale {scale}"


def _tolokers_inline(path: Path) -> GraphData:
    import numpy as np

    with np.load(path) as archive:
        edges = torch.from_numpy(archive["edges"].astype("int64")).t()
        x = torch.from_numpy(archive["node_features"]).float()
    both_ways = torch.unique(torch.cat([edges, edges.flip(0)], 1), dim=1)  # as PyG's to_undirected
    return GraphData.from_edge_index(both_ways, x, name="tolokers")


def _power_law_inline(scale: float) -> GraphData:
    num_nodes, num_edges = round(232_965 * scale), round(114_615_892 * scale)
    gen = torch.Generator().manual_seed(0)
    weight = torch.arange(1, num_nodes + 1, dtype=torch.float64) ** -0.66  # Zipf-like degrees
    src = torch.multinomial(weight, num_edges, replacement=True, generator=gen)
    dst = torch.multinomial(weight, num_edges, replacement=True, generator=gen)
    return GraphData.from_edge_index(torch.stack([src, dst]), torch.zeros(num_nodes, 1), name="power-law")


# ---- implementations ------------------------------------------------------------------------


def make_impls(graph: GraphData, fanouts: list[int], names: list[str]) -> tuple[dict[str, SampleFn], list[str]]:
    impls: dict[str, SampleFn] = {}
    notes: list[str] = []
    counter = iter(range(1 << 62))  # a fresh batch seed per call, as serving does
    if "reference" in names:
        ref = ReferenceSampler(graph.indptr, graph.indices)
        impls["reference"] = lambda s: sum(ref.sample(s, fanouts, next(counter)).num_sampled_edges)
    if "cpp" in names:
        if cpp_sampler_available():
            cpp = CppSampler(graph.indptr, graph.indices)
            impls["cpp"] = lambda s: sum(cpp.sample(s, fanouts, next(counter)).num_sampled_edges)
        else:
            notes.append(f"cpp skipped: {cpu_sampler_status()}")
    if "pyg" in names:
        pyg, note = _make_pyg(graph, fanouts)
        notes.append(note)
        if pyg is not None:
            impls["pyg"] = pyg
    return impls, notes


def _make_pyg(graph: GraphData, fanouts: list[int]) -> tuple[SampleFn | None, str]:
    try:
        import torch_sparse  # noqa: F401  (PyG's sampler backend without pyg-lib)
        from torch_geometric.data import Data
        from torch_geometric.sampler import NeighborSampler, NodeSamplerInput
    except ImportError as exc:
        return None, (f"PyG baseline skipped: {exc} (run in the bench venv: "
                      ".bench_env/bin/python -m bench.sampling.cpu_sampler)")
    import torch_geometric.typing as pyg_typing

    backend = "pyg-lib" if pyg_typing.WITH_PYG_LIB else "torch_sparse.neighbor_sample"
    # edge_index() is already sorted by target, so PyG's CSC equals ours (is_sorted skips a re-sort).
    data = Data(edge_index=graph.edge_index(), num_nodes=graph.num_nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pyg-lib missing" deprecation notice
        sampler = NeighborSampler(data, num_neighbors=fanouts, replace=False,
                                  subgraph_type="directional", is_sorted=True)

    def sample(seeds: torch.Tensor) -> int:
        out = sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
        return int(out.row.numel())

    return sample, f"PyG baseline: NeighborSampler(replace=False, directional) via {backend}"


# ---- timing ---------------------------------------------------------------------------------


def seed_batches(num_nodes: int, batch: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randperm(num_nodes, generator=gen)[:batch] for _ in range(count)]


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process), to tell others' load apart."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = sum(int(f) for f in Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    return busy, own


def others_busy_cores(window_s: float) -> float:
    """Cores other processes kept busy over the next ``window_s`` seconds."""
    (busy0, own0), t0 = cpu_jiffies(), time.perf_counter()
    time.sleep(window_s)
    (busy1, own1), wall_s = cpu_jiffies(), time.perf_counter() - t0
    return max(0.0, ((busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / wall_s)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.2) -> None:
    """On a shared dev box, start a cell when other processes are (nearly) idle, or give up."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline and others_busy_cores(0.5) > threshold_cores:
        pass


def time_cell(impls: dict[str, SampleFn], batches: list[torch.Tensor],
              max_seconds: float) -> dict[str, tuple[list[float], int]]:
    """Per-call latencies (s) and total sampled edges of each implementation, after a warm-up.

    Implementations take turns on the same batch, so load from other processes on a shared box
    hits them alike and the ratios stay fair even when absolute numbers are noisy.
    """
    for fn in impls.values():
        fn(batches[0])
    results: dict[str, tuple[list[float], int]] = {name: ([], 0) for name in impls}
    deadline = time.perf_counter() + max_seconds * len(impls)
    for i, seeds in enumerate(batches):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            edges = fn(seeds)
            elapsed_s = time.perf_counter() - t0
            latencies_s, total = results[name]
            latencies_s.append(elapsed_s)
            results[name] = (latencies_s, total + edges)
        if i + 1 >= MIN_REPEATS and time.perf_counter() > deadline:
            break
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_grid(impls: dict[str, SampleFn], num_nodes: int, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for batch in args.batch_sizes:
        batches = seed_batches(num_nodes, min(batch, num_nodes), args.repeats)
        for threads in args.threads:
            torch.set_num_threads(threads)
            wait_for_quiet(args.wait_quiet_s)
            (busy0, own0), t0 = cpu_jiffies(), time.perf_counter()
            cell = time_cell(impls, batches, args.max_seconds)
            (busy1, own1), wall_s = cpu_jiffies(), time.perf_counter() - t0
            others = ((busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / wall_s
            for name, (lat_s, edges) in cell.items():
                rows.append(Row(name, threads, batch, len(lat_s), 1e3 * percentile(lat_s, 50),
                                1e3 * percentile(lat_s, 99), edges / len(lat_s), edges / sum(lat_s),
                                max(0.0, others)))
                print(f"  {name:9s} threads={threads} batch={batch:5d}: {rows[-1].edges_per_s / 1e6:7.2f} "
                      f"M edges/s (others busy {others:.2f} cores)", file=sys.stderr, flush=True)
    pyg = {(r.threads, r.batch): r.edges_per_s for r in rows if r.impl == "pyg"}
    for r in rows:
        r.ratio_vs_pyg = r.edges_per_s / pyg[(r.threads, r.batch)] if (r.threads, r.batch) in pyg else None
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'impl':9s} {'thr':>3s} {'batch':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'edges/batch':>11s} "
          f"{'M edges/s':>9s} {'vs PyG':>7s} {'others':>6s}")
    for r in rows:
        ratio = f"{r.ratio_vs_pyg:6.2f}x" if r.ratio_vs_pyg is not None else "      -"
        print(f"{r.impl:9s} {r.threads:3d} {r.batch:5d} {r.p50_ms:9.3f} {r.p99_ms:9.3f} "
              f"{r.edges_per_batch:11.0f} {r.edges_per_s / 1e6:9.2f} {ratio} {r.other_cores_busy:6.2f}")


def machine_info() -> dict[str, object]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


# ---- memory of a spawned worker --------------------------------------------------------------


@dataclass
class WorkerMemory:
    """What a worker's /proc/self/smaps_rollup says after sampling (kB, as the kernel reports)."""

    label: str
    rss_kb: int
    pss_kb: int
    uss_kb: int  # Private_Clean + Private_Dirty: what the kernel would free if the worker died
    pss_shmem_kb: int | None
    sampled_edges: int


def read_smaps_rollup() -> dict[str, int]:
    fields: dict[str, int] = {}
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():  # pre-4.14 kernels: only RSS is available
        return {"Rss": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024}
    for line in path.read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields


def _release_free_heap() -> None:
    """Return freed sampling buffers to the OS (glibc keeps them), so USS shows what is held."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the numbers then include the allocator's cache
        pass


def memory_worker(label: str, indptr: torch.Tensor, indices: torch.Tensor, fanouts: list[int],
                  private_copy: bool, result_queue) -> None:
    """Spawned: sample with the C++ sampler over every node (touching the whole CSC), report memory.

    ``private_copy`` is the control: a worker that clones the CSC must show it in USS.
    """
    torch.set_num_threads(1)
    if private_copy:
        indptr, indices = indptr.clone(), indices.clone()
    sampler = CppSampler(indptr, indices)
    num_nodes = sampler.num_nodes
    edges = 0
    for lo in range(0, num_nodes, 1024):  # exact mode reads every neighbour list once
        edges += sum(sampler.sample(torch.arange(lo, min(lo + 1024, num_nodes)), [-1], 0).num_sampled_edges)
    gen = torch.Generator().manual_seed(0)
    for i in range(20):
        seeds = torch.randint(0, num_nodes, (1024,), generator=gen)
        edges += sum(sampler.sample(seeds, fanouts, i).num_sampled_edges)
    _release_free_heap()
    m = read_smaps_rollup()
    uss = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
    result_queue.put(WorkerMemory(label, m["Rss"], m.get("Pss", 0), uss, m.get("Pss_Shmem"), edges))


def spawn_memory_worker(label: str, indptr: torch.Tensor, indices: torch.Tensor, fanouts: list[int],
                        timeout_s: float, private_copy: bool = False) -> WorkerMemory:
    ctx = torch.multiprocessing.get_context("spawn")
    result_queue = ctx.Queue()
    proc = ctx.Process(target=memory_worker,
                       args=(label, indptr, indices, fanouts, private_copy, result_queue))
    proc.start()
    try:
        return result_queue.get(timeout=timeout_s)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def memory_report(args: argparse.Namespace) -> dict[str, object]:
    """Spawn workers that get the shared CSC as Process args; compare their memory to its size."""
    graph, note = load_bench_graph("reddit", args.memory_scale)
    graph.share_memory_()
    csc_bytes = graph.indptr.nbytes + graph.indices.nbytes
    print(f"{graph.describe()} ({note}); CSC (indptr + indices) = {csc_bytes / 2**20:.0f} MiB in shared memory")
    tiny = GraphData.from_edge_index(torch.randint(0, 1000, (2, 10_000)), torch.zeros(1000, 1), name="tiny")
    tiny.share_memory_()
    results = [
        spawn_memory_worker("baseline: 1k-node graph", tiny.indptr, tiny.indices, args.fanouts, args.memory_timeout_s),
        spawn_memory_worker("shared reddit CSC", graph.indptr, graph.indices, args.fanouts, args.memory_timeout_s),
        spawn_memory_worker("control: worker clones CSC", graph.indptr, graph.indices, args.fanouts,
                            args.memory_timeout_s, private_copy=True),
    ]
    base_uss_kb = results[0].uss_kb
    print(f"{'worker':26s} {'RSS MiB':>8s} {'PSS MiB':>8s} {'USS MiB':>8s} {'PSS shmem':>9s} {'USS - base':>10s}")
    for m in results:
        shmem = f"{m.pss_shmem_kb / 1024:9.0f}" if m.pss_shmem_kb is not None else "        -"
        print(f"{m.label:26s} {m.rss_kb / 1024:8.0f} {m.pss_kb / 1024:8.0f} {m.uss_kb / 1024:8.0f} {shmem} "
              f"{round((m.uss_kb - base_uss_kb) / 1024):10d}")
    extra_mib = round((results[1].uss_kb - base_uss_kb) / 1024)
    print(f"private memory the shared graph adds to a worker: {extra_mib} MiB "
          f"({100 * extra_mib * 2**20 / csc_bytes:.1f}% of the {csc_bytes / 2**20:.0f} MiB CSC)")
    return {"graph": graph.describe(), "note": note, "csc_bytes": csc_bytes,
            "workers": [asdict(m) for m in results]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", choices=["tolokers", "reddit"], default="tolokers")
    p.add_argument("--scale", type=float, default=0.25, help="reddit: fraction of the preset's size")
    p.add_argument("--fanouts", type=lambda s: [int(k) for k in s.split(",")], default=[25, 10])
    p.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 128, 1024, 8192])
    p.add_argument("--impls", type=lambda s: s.split(","), default=["reference", "cpp", "pyg"])
    p.add_argument("--threads", type=lambda s: [os.cpu_count() or 1 if t == "all" else int(t) for t in s.split(",")],
                   default="1,all", help="comma list of intra-op thread counts; 'all' = every core")
    p.add_argument("--repeats", type=int, default=300, help="most timed calls per cell")
    p.add_argument("--max-seconds", type=float, default=3.0, help="time budget per cell (at least 5 calls)")
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="before each cell, wait up to this long for other processes to go idle")
    p.add_argument("--memory", action="store_true", help="measure a spawned worker's RSS/PSS/USS instead")
    p.add_argument("--memory-scale", type=float, default=1.0, help="reddit scale for --memory")
    p.add_argument("--memory-timeout-s", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--tolokers-npz", type=Path, default=DEFAULT_TOLOKERS_NPZ,
                   help="the heterophilous-graphs tolokers.npz (default: the shared data folder "
                        "beside the repository)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report: dict[str, object] = {"meta": run_meta(args), "machine": machine_info(), "args": {
        k: portable(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()}}
    if args.memory:
        report["memory"] = memory_report(args)
    else:
        graph, note = load_bench_graph(args.graph, args.scale, args.tolokers_npz)
        impls, notes = make_impls(graph, args.fanouts, args.impls)
        print(f"{graph.describe()} ({note}); fanouts {args.fanouts}; {report['machine']}")
        for line in notes:
            print(f"note: {line}")
        rows = run_grid(impls, graph.num_nodes, args)
        print_table(rows)
        report.update(graph=graph.describe(), graph_note=note, notes=notes, rows=[asdict(r) for r in rows])
    if args.json:
        write_result(args.json, report)


if __name__ == "__main__":
    main()
