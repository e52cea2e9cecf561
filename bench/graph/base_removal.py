"""What removing base edges costs the overlay: cuts (decision 0069) against whole-list copies.

A random graph with skewed in-degrees (--nodes, --edges; a dst is drawn with weight
``rank ** -skew``, so hubs hold most edges) and one stream of update calls (--calls of
--edges-per-call edges, --remove-fraction of them removals of base edges drawn uniformly over
the edges, so hubs lose edges as often as they hold them; the rest adds drawn alike). The same
stream is applied to two overlays over the same base, one per layout, call by call in one
process: ``cut`` (a removal cuts the base list, ``graph/base_cut.py``) and ``copy`` (the node's
surviving list copied into the arena, the layout before). Per layout: plan-and-apply time per
call (p50 / p99 / max), arena entries written per call (what a follower and the GPU copy
receive, and what the log holds with each planned record), arena used at the end; and whether
both hold the same multiset of in-edges for every node at the end.

    python -m bench.graph.base_removal --nodes 233000 --edges 20000000 --calls 300
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from tqdm import tqdm

from loadtest import results
from quiver_serve.graph.overlay import Overlay

LAYOUTS = ("cut", "copy")


def skewed_graph(rng: np.random.Generator, nodes: int, edges: int,
                 skew: float) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(indptr, indices sorted per list, dst weights): in-degrees follow a power law."""
    weight = np.arange(1, nodes + 1, dtype=np.float64) ** -skew
    weight = rng.permutation(weight / weight.sum())
    dst = rng.choice(nodes, edges, p=weight)
    src = rng.integers(0, nodes, edges)
    order = np.lexsort((src, dst))
    indptr = np.zeros(nodes + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=nodes), out=indptr[1:])
    return torch.from_numpy(indptr), torch.from_numpy(src[order]), weight


def stream(rng: np.random.Generator, indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray,
           args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:
    """The update calls: (adds, removals of distinct base edges)."""
    n_rm = int(round(args.edges_per_call * args.remove_fraction))
    picks = rng.choice(indices.size, n_rm * args.calls, replace=False)
    dst_of = np.searchsorted(indptr, picks, side="right") - 1
    removals = np.stack([indices[picks], dst_of], 1).reshape(args.calls, n_rm, 2)
    n = indptr.size - 1
    calls = []
    for i in range(args.calls):
        adds = np.stack([rng.integers(0, n, args.edges_per_call - n_rm),
                         rng.choice(n, args.edges_per_call - n_rm, p=weight)], 1)
        calls.append((adds, removals[i]))
    return calls


def pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"p50": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "mean": float(a.mean())}


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    indptr, indices, weight = skewed_graph(rng, args.nodes, args.edges, args.skew)
    calls = stream(rng, indptr.numpy(), indices.numpy(), weight, args)
    degree = np.diff(indptr.numpy())
    print(f"graph {args.nodes:,} nodes, {args.edges:,} edges (max in-degree {degree.max():,}, "
          f"p99 {np.percentile(degree, 99):.0f}) and {args.calls} calls in "
          f"{time.perf_counter() - t0:.1f} s")
    overlays = {name: Overlay(indptr, indices, args.nodes, args.capacity_edges, 0,
                              cut_base=name == "cut") for name in LAYOUTS}
    seconds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    entries: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    counts = {name: np.zeros(3, np.int64) for name in LAYOUTS}  # added, removed, missing
    for adds, removes in tqdm(calls, desc="update calls", unit="call"):
        for name, ov in overlays.items():
            t1 = time.perf_counter()
            result, patch = ov.apply_edges(adds, removes)
            seconds[name].append((time.perf_counter() - t1) * 1e3)
            entries[name].append(float(patch.tail_pos.size))
            counts[name] += (result.added, result.removed, result.missing)
    out: dict = {"graph": {"nodes": args.nodes, "edges": args.edges,
                           "max_in_degree": int(degree.max())}}
    for name, ov in overlays.items():
        out[name] = {"call_ms": pct(seconds[name]), "entries_per_call": pct(entries[name]),
                     "added_removed_missing": counts[name].tolist(),
                     "arena_used": ov.top, "arena_mb": ov.top * 8 / 2**20}
    out["same_lists"] = same_lists(overlays["cut"], overlays["copy"], args.nodes) \
        and np.array_equal(counts["cut"], counts["copy"])
    out["ratio_copy_over_cut"] = {
        "call_p99": out["copy"]["call_ms"]["p99"] / out["cut"]["call_ms"]["p99"],
        "entries_mean": out["copy"]["entries_per_call"]["mean"]
        / max(out["cut"]["entries_per_call"]["mean"], 1.0),
        "arena_used": out["copy"]["arena_used"] / max(out["cut"]["arena_used"], 1)}
    return out


def same_lists(a: Overlay, b: Overlay, nodes: int, chunk: int = 1 << 15) -> bool:
    """Whether both overlays hold the same multiset of in-edges for every node."""
    for lo in range(0, nodes, chunk):
        ids = np.arange(lo, min(nodes, lo + chunk))
        (va, ca), (vb, cb) = a.neighbour_lists(ids), b.neighbour_lists(ids)
        if not np.array_equal(ca, cb):
            return False
        owner = np.repeat(ids, ca)
        if not np.array_equal(np.sort(owner * nodes + va), np.sort(owner * nodes + vb)):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=233_000)
    ap.add_argument("--edges", type=int, default=20_000_000)
    ap.add_argument("--skew", type=float, default=0.9, help="power of the in-degree law")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--edges-per-call", type=int, default=2000)
    ap.add_argument("--remove-fraction", type=float, default=0.1)
    ap.add_argument("--capacity-edges", type=int, default=1 << 27)
    ap.add_argument("--seed", type=int, default=0)
    results.add_result_options(ap)
    ap.add_argument("--out", help="result file (default: bench/results/base_removal_<machine>_<date>.json)")
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(results.jsonable(result), indent=1))
    results.write_result(results.result_path("base_removal", args),
                         {"meta": results.run_meta(args), "result": result})


if __name__ == "__main__":
    main()
