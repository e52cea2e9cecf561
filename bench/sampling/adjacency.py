#!/usr/bin/env python
"""UVA sampling with an adjacency cache vs device-resident and plain UVA (issue 11, target A).

For a graph already in memory: the device-resident CSC, plain UVA, and UVA with a cache of
``--budget`` of the int64 CSC bytes in each layout of ``LAYOUTS`` (``int64``: the first layout
and scores; ``int32``; ``packed``: the fewest bits per id, per-hop sector scores), at 1,024 and
8,192 uniform seeds, fanouts [25, 10]. Each cached sampler is checked bit-identical to plain
UVA. Next to each timing: the CPU read model's share of bus sectors, neighbour reads, lists and
indptr reads the cache serves (``features/adjacency_reads.py``) and the time the share of bus
requests (sectors plus one indptr read per frontier node) predicts,
``device + (1 - requests served) * (uva - device)``.

Used by bench/features/features_e2e.py; alone (CPU: only the read model):
    python -m bench.sampling.adjacency [--scale 0.1] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.features.common import FANOUTS, make_graph, sync, timed
from loadtest.results import run_meta, write_result
from quiver_serve.sampling.graph_cache.adjacency import build_adjacency_cache, expansion_scores
from quiver_serve.sampling.graph_cache.reads import served_shares

#: name: (index_bits, score cost); None = the fewest bits that hold the node ids
LAYOUTS = {"int64": (64, "reads_any_hop"), "int32": (32, "sectors"), "packed": (None, "sectors"),
           "ef": (0, "sectors")}  # ef: Elias-Fano (features/elias_fano.py)
#: more (layout, score) pairs for the read model alone (``--layouts``): which change does what
EXTRA_LAYOUTS = {"int64-sectors": (64, "sectors"), "packed-reads_any_hop": (None, "reads_any_hop"),
                 "packed-reads": (None, "reads")}
SEED_COUNTS = (1024, 8192)


def build_caches(graph: Any, dev: torch.device, budget_frac: float,
                 layouts: list[str] | None = None) -> dict[str, dict]:
    """Per layout (default ``LAYOUTS``): the cache on ``dev`` and how long scoring and building
    took."""
    csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
    on = dev if dev.type == "cuda" else torch.device("cpu")
    indptr, indices = graph.indptr.to(on), graph.indices.to(on)
    scores: dict[str, torch.Tensor] = {}
    out = {}
    for name in layouts or list(LAYOUTS):
        bits, cost = {**LAYOUTS, **EXTRA_LAYOUTS}[name]
        t0 = time.perf_counter()
        if cost not in scores:
            scores[cost] = expansion_scores(indptr, indices, FANOUTS, 1024, cost=cost).cpu()
        cache = build_adjacency_cache(graph.indptr, graph.indices, scores[cost],
                                      int(budget_frac * csc_bytes), dev, bits)
        sync(dev)
        assert cache is not None
        out[name] = {"cache": cache, "build_s": time.perf_counter() - t0}
        print(f"adjacency cache {name:6s}: {cache.index_bits} bits, {cache.num_cached:,} lists "
              f"of {graph.num_nodes:,}, {cache.nbytes / 1e6:.1f} MB "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    del indptr, indices
    return out


def model_rows(graph: Any, caches: dict[str, dict], batches: int) -> dict[tuple[str, int], dict]:
    """The read model's shares per (layout, seeds); layout "uva" = no cache."""
    rows = {}
    g = torch.Generator().manual_seed(11)
    for n in SEED_COUNTS:
        seeds = [torch.randint(0, graph.num_nodes, (n,), generator=g)
                 for _ in range(max(1, batches * 1024 // n))]
        rows[("uva", n)] = served_shares(graph.indptr, graph.indices, seeds, FANOUTS, None)
        for name, c in caches.items():
            cached = c["cache"].offsets.cpu() >= 0
            rows[(name, n)] = served_shares(graph.indptr, graph.indices, seeds, FANOUTS, cached)
            r = rows[(name, n)]
            print(f"read model {name:6s} {n:5d} seeds: sectors {r['sectors_served']:.3f} reads "
                  f"{r['reads_served']:.3f} lists {r['lists_served']:.3f} indptr "
                  f"{r['indptr_reads_served']:.3f} served by the cache", flush=True)
    return rows


def timing_rows(graph: Any, dev: torch.device, caches: dict[str, dict], iters: int) -> list[dict]:
    from quiver_serve.sampling.gpu import CudaSampler, UvaSampler

    samplers = {"device": CudaSampler(graph.indptr, graph.indices, device=dev),
                "uva": UvaSampler(graph.indptr, graph.indices, device=dev)}
    for name, c in caches.items():
        samplers[f"uva+{name}"] = UvaSampler(graph.indptr, graph.indices, device=dev,
                                             adjacency_cache=c["cache"])
    rows = []
    g = torch.Generator().manual_seed(3)
    for n in SEED_COUNTS:
        seeds = torch.randint(0, graph.num_nodes, (n,), generator=g)
        ref = samplers["uva"].sample(seeds, FANOUTS, 3)
        for name, s in samplers.items():
            got = s.sample(seeds, FANOUTS, 3)
            same = bool(torch.equal(got.n_id, ref.n_id) and torch.equal(got.edge_index,
                                                                        ref.edge_index))
            sec = timed(lambda s=s, x=seeds: s.sample(x, FANOUTS, 3), dev, iters)
            rows.append({"sampler": name, "seeds": n, "sample_ms": sec * 1e3,
                         "identical_to_uva": same})
            print(f"adjacency {name:11s} {n:5d} seeds: {sec * 1e3:.3f} ms identical {same}",
                  flush=True)
    for s in samplers.values():
        getattr(s, "close", lambda: None)()
    return rows


def adjacency_section(graph: Any, dev: torch.device, budget_frac: float, iters: int,
                      model_batches: int, layouts: list[str] | None = None) -> dict:
    """Timings (GPU only), read-model shares and predictions; JSON-ready."""
    caches = build_caches(graph, dev, budget_frac, layouts)
    model = model_rows(graph, caches, model_batches)
    timing = timing_rows(graph, dev, caches, iters) if dev.type == "cuda" else []
    ms = {(r["sampler"], r["seeds"]): r["sample_ms"] for r in timing}
    rows = []
    for n in SEED_COUNTS:
        for name in ("device", "uva", *caches):
            key = "uva" if name == "device" else name
            m = model[(key, n)]
            row = {"sampler": name if name in ("device", "uva") else f"uva+{name}", "seeds": n,
                   "sectors_served": m["sectors_served"] if name != "device" else None,
                   "reads_served": m["reads_served"], "lists_served": m["lists_served"],
                   "indptr_reads_served": m["indptr_reads_served"],
                   "hop_sector_share": m["hop_sector_share"], "bus_sectors": m["sectors"],
                   # with indptr: one sector per frontier node without a cache, none with one
                   "requests_served": (m["sectors_cached"] + m["indptr_reads_cached"] / 2) / max(
                       m["sectors"] + m["lists"], 1)}
            if name in caches:
                c = caches[name]["cache"]
                deg = graph.indptr[1:] - graph.indptr[:-1]
                row.update(index_bits=c.index_bits, cached_lists=c.num_cached,
                           cached_entries_share=float(deg[c.offsets.cpu() >= 0].sum())
                           / max(graph.num_edges, 1),
                           cache_bytes=c.nbytes, build_s=caches[name]["build_s"])
            t = next((r for r in timing if r["sampler"] == row["sampler"] and r["seeds"] == n),
                     None)
            if t is not None:
                row.update(sample_ms=t["sample_ms"], identical_to_uva=t["identical_to_uva"],
                           vs_device=t["sample_ms"] / ms[("device", n)])
                if name in caches:
                    row["predicted_ms"] = ms[("device", n)] + (1 - row["requests_served"]) * (
                        ms[("uva", n)] - ms[("device", n)])
            rows.append(row)
    return {"budget_frac_of_int64_csc": budget_frac,
            "csc_int64_bytes": (graph.indptr.numel() + graph.indices.numel()) * 8, "rows": rows}


def print_table(section: dict) -> None:
    print(f"\n| sampler ({section['budget_frac_of_int64_csc']:.0%} of int64 CSC bytes) | seeds | "
          "ms | x device | predicted ms | sectors / reads / lists served | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in section["rows"]:
        ms = f"{r['sample_ms']:.3f}" if "sample_ms" in r else "-"
        vs = f"{r['vs_device']:.2f}" if "vs_device" in r else "-"
        pred = f"{r['predicted_ms']:.3f}" if "predicted_ms" in r else "-"
        served = "-" if r["sectors_served"] is None else (
            f"{r['sectors_served']:.3f} / {r['reads_served']:.3f} / {r['lists_served']:.3f}")
        print(f"| {r['sampler']} | {r['seeds']} | {ms} | {vs} | {pred} | {served} | "
              f"{r.get('identical_to_uva', '-')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="Reddit preset scale")
    ap.add_argument("--budget", type=float, nargs="+", default=[0.2],
                    help="shares of the int64 CSC bytes (one section each, one graph)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--model-batches", type=int, default=3, help="read-model batches of 1,024")
    ap.add_argument("--layouts", nargs="+", choices=[*LAYOUTS, *EXTRA_LAYOUTS],
                    help=f"cache layouts and scores (default: {' '.join(LAYOUTS)})")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    graph, gen_s = make_graph("reddit", args.scale)
    print(f"reddit scale {args.scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
          f"({gen_s:.1f} s)", flush=True)
    sections = [adjacency_section(graph, dev, b, args.iters, args.model_batches, args.layouts)
                for b in args.budget]
    if args.out:
        write_result(args.out, {"meta": run_meta(args), "sections": sections})
    for section in sections:
        print_table(section)


if __name__ == "__main__":
    main()
