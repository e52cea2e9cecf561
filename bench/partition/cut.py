#!/usr/bin/env python
"""Edge cut and remote traffic of a partitioning (docs/decisions/0042-partitioning.md), on the
project's synthetic papers100M-shaped graph: per method and partition count, the seconds and
peak memory of the assignment, the edge cut, the balance, and what a request sends between
partition servers when it is sampled and gathered where its seed's owner is (the reference
sampler's subgraph on the whole graph, the same one a partitioned deployment draws):

* sampling: each frontier node owned elsewhere is one id out (8 B) and its drawn neighbours back
  (8 B each), batched into one call per other partition per hop;
* features: each sampled node owned elsewhere and not replicated is one id out (8 B) and one
  float32 row back (4 B x features), one call per other partition.

Single-id requests and batches of ``--batch-size`` seeds of one partition are measured, with no
replicated rows and with ``--hot-fraction`` of the graph's rows replicated on every partition
(chosen by FAP, ``partition/hot.py``).

    python -m bench.partition.cut                                   # scale 0.01, P = 16 and 64
    python -m bench.partition.cut --scale 0.02 --parts 16 64 --methods metis hash
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadtest.results import doc_parser, run_meta, write_result
from quiver_serve.config import GraphConfig
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.partition.hot import hot_rows
from quiver_serve.partition.methods import assign, balance_weights
from quiver_serve.partition.stats import balance, edge_cut
from quiver_serve.sampling.reference import ReferenceSampler

ID_BYTES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.partition.cut", __doc__)
    ap.add_argument("--preset", default="papers100m")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--parts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--methods", nargs="+", default=["metis", "hash"])
    ap.add_argument("--fanouts", type=int, nargs="+", default=[25, 10])
    ap.add_argument("--singles", type=int, default=2000, help="single-id requests sampled")
    ap.add_argument("--batches", type=int, default=8, help="batches per partition count")
    ap.add_argument("--traffic-parts", type=int, default=4,
                    help="partitions whose requests are measured (their hot rows computed)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--hot-fraction", type=float, default=0.02,
                    help="rows replicated on each partition, as a share of the graph's rows")
    ap.add_argument("--out", help="result file (default bench/results/partition_cut_<machine>"
                                  "_<date>.json)")
    ap.add_argument("--machine", default="cpu2")
    return ap.parse_args(argv)


def resident_gb() -> float:
    """This process's resident memory now (GB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def timed_assign(indptr: np.ndarray, indices: np.ndarray, parts: int,
                 method: str) -> tuple[np.ndarray, float, float]:
    """``(owner, seconds, GB)`` of the assignment: run in a forked child, whose peak resident
    memory less what it inherited resident is what the assignment itself took."""
    inherited_gb = resident_gb()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "owner.npy"
        pid = os.fork()
        if pid == 0:  # the child: assign, save, leave without cleanup handlers
            code = 1
            try:
                t0 = time.perf_counter()
                owner = assign(indptr, indices, parts, method)
                np.save(out, owner)
                (Path(tmp) / "seconds").write_text(str(time.perf_counter() - t0))
                code = 0
            finally:
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        if status != 0:
            raise RuntimeError(f"{method} into {parts} parts failed in the child ({status})")
        seconds = float((Path(tmp) / "seconds").read_text())
        # ru_maxrss is in KiB on Linux
        return np.load(out), seconds, max(0.0, usage.ru_maxrss * 1024 / 1e9 - inherited_gb)


def request_traffic(sampler: ReferenceSampler, owner: np.ndarray, part: int, seeds: np.ndarray,
                    fanouts: list[int], hot: np.ndarray | None, num_features: int,
                    seed: int) -> dict[str, float]:
    """What one request of ``seeds`` (all owned by ``part``) sends between partitions."""
    out = sampler.sample(torch.from_numpy(seeds), fanouts, seed)
    n_id = out.n_id.numpy()
    remote = owner[n_id] != part
    bounds = np.cumsum([0, *out.num_sampled_nodes])
    edge_bounds = np.cumsum([0, *out.num_sampled_edges])
    cols = out.edge_index[1].numpy()
    sample_bytes, sample_calls = 0, 0
    for hop in range(len(fanouts)):
        expanded = np.arange(bounds[hop], bounds[hop + 1])
        drawn = np.bincount(cols[edge_bounds[hop]:edge_bounds[hop + 1]] - bounds[hop],
                            minlength=expanded.size)
        far = remote[expanded]
        sample_bytes += ID_BYTES * int(far.sum()) + ID_BYTES * int(drawn[far].sum())
        sample_calls += np.unique(owner[n_id[expanded[far]]]).size
    fetch = remote.copy()
    if hot is not None and hot.size:
        fetch &= ~np.isin(n_id, hot)
    rows = int(fetch.sum())
    return {"nodes": int(n_id.size), "remote_nodes": int(remote.sum()), "remote_rows": rows,
            "sample_bytes": sample_bytes, "sample_calls": sample_calls,
            "feature_bytes": rows * (ID_BYTES + 4 * num_features),
            "feature_calls": int(np.unique(owner[n_id[fetch]]).size)}


def traffic(sampler: ReferenceSampler, owner: np.ndarray, measured: np.ndarray,
            args: argparse.Namespace, hot: dict[int, np.ndarray] | None,
            num_features: int) -> dict[str, Any]:
    """Mean traffic per single-id request and per batch (and per seed of a batch), of requests
    for the nodes of the ``measured`` partitions (partitions are alike: a few stand for all)."""
    rng = np.random.default_rng(7)
    pool = np.flatnonzero(np.isin(owner, measured))
    singles = [request_traffic(sampler, owner, int(owner[v]), np.array([v]), args.fanouts,
                               None if hot is None else hot[int(owner[v])], num_features, i)
               for i, v in enumerate(rng.choice(pool, args.singles))]
    batches = []
    for i in range(args.batches):
        part = int(measured[i % measured.size])
        mine = np.flatnonzero(owner == part)
        seeds = rng.choice(mine, min(args.batch_size, mine.size), replace=False)
        batches.append(request_traffic(sampler, owner, part, seeds, args.fanouts,
                                       None if hot is None else hot[part], num_features, 1000 + i))
    mean = {k: float(np.mean([s[k] for s in singles])) for k in singles[0]}
    bmean = {k: float(np.mean([b[k] for b in batches])) for k in batches[0]}
    return {"single": mean, "batch": bmean,
            "batch_per_seed_bytes": (bmean["sample_bytes"] + bmean["feature_bytes"])
            / args.batch_size}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    cfg = GraphConfig(format="synthetic", path=None, name=f"{args.preset}-syn",
                      synthetic_preset=args.preset, synthetic_scale=args.scale)
    t0 = time.perf_counter()
    graph = generate_synthetic(cfg)
    gen_s = time.perf_counter() - t0
    indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
    print(f"{graph.describe()} generated in {gen_s:.1f} s", flush=True)
    sampler = ReferenceSampler(graph.indptr, graph.indices)
    degree = np.diff(indptr)
    runs = []
    for parts in args.parts:
        for method in args.methods:
            owner, seconds, peak_gb = timed_assign(indptr, indices, parts, method)
            cut = edge_cut(indptr, indices, owner)
            weights = np.bincount(owner, weights=balance_weights(indptr), minlength=parts)
            run = {"method": method, "parts": parts, "assign_s": seconds, "assign_gb": peak_gb,
                   "edge_cut": cut, "edge_cut_fraction": cut / graph.num_edges,
                   "node_balance": balance(np.bincount(owner, minlength=parts)),
                   "edge_balance": balance(np.bincount(owner, weights=degree, minlength=parts)),
                   "weight_balance": balance(weights)}
            print(f"{method} P={parts}: {seconds:.1f} s, {peak_gb:.2f} GB above the graph, cut "
                  f"{run['edge_cut_fraction']:.3f}, balance nodes {run['node_balance']:.3f} "
                  f"edges {run['edge_balance']:.3f}", flush=True)
            measured = np.random.default_rng(parts).choice(
                parts, min(parts, args.traffic_parts), replace=False)
            run["traffic_parts"] = measured.tolist()
            run["traffic_no_hot"] = traffic(sampler, owner, measured, args, None,
                                            graph.num_features)
            t0 = time.perf_counter()
            max_rows = int(args.hot_fraction * graph.num_nodes)
            hot = {int(p): hot_rows(graph.indptr, graph.indices, owner, int(p), args.fanouts,
                                    1024, max_rows)[0] for p in measured}
            run["hot_s_per_part"] = (time.perf_counter() - t0) / measured.size
            run["traffic_hot"] = traffic(sampler, owner, measured, args, hot, graph.num_features)
            print(f"  per single id: {run['traffic_no_hot']['single']}\n  with hot rows: "
                  f"{run['traffic_hot']['single']}", flush=True)
            runs.append(run)
    result = {"meta": run_meta(args, graph=graph.describe(), scale=args.scale,
                               batch_size=args.batch_size, singles=args.singles,
                               batches=args.batches, traffic_parts=args.traffic_parts,
                               preset=args.preset, fanouts=args.fanouts,
                               max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6),
              "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges,
                        "features": graph.num_features, "generate_s": gen_s},
              "hot_fraction": args.hot_fraction, "runs": runs,
              "wall_s": time.perf_counter() - t_start}
    date = time.strftime("%Y-%m-%d", time.gmtime())
    write_result(args.out or f"bench/results/partition_cut_{args.machine}_{date}.json", result)


if __name__ == "__main__":
    main()
