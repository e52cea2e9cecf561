#!/usr/bin/env python
"""The paper plan of a graph past these machines (docs/decisions/0043-partitioned-at-scale.md):
a 1 B-node, 20 B-edge graph with 256 float32 features over P hosts. From a ``bench.partition.cut``
result (edge cut, balance and remote traffic measured on a smaller papers100M-shaped graph) it
computes, per method and P: bytes per host (CSC, features, book, replicated rows), remote bytes
per request, their network time at 25 and 100 Gb/s, the seeds/s one host's link carries, and
how many seeds a batch may hold for each remote hop to fit its share of the p99 budget.

    python -m bench.partition.plan bench/results/partition_cut_cpu2_<date>.json

Assumptions (arguments): the p99 budget is the project's 10 ms (docs/architecture.md,
"Performance contract"), of which the front door, the local first hop and the model take
``--local-ms``; the two remote steps (the second hop's sampling, the feature gather) share the
rest equally; each costs a round trip of ``--rtt-ms`` at p99 plus its bytes at line rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from loadtest.results import doc_parser, run_meta, write_result

ID_BYTES = 8
GBIT = 1e9 / 8  # bytes per second of 1 Gb/s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.partition.plan", __doc__)
    ap.add_argument("cut", help="a bench.partition.cut result")
    ap.add_argument("--nodes", type=float, default=1e9)
    ap.add_argument("--edges", type=float, default=20e9)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--links-gbit", type=float, nargs="+", default=[25.0, 100.0])
    ap.add_argument("--p99-ms", type=float, default=10.0)
    ap.add_argument("--local-ms", type=float, default=4.0,
                    help="p99 of the front door, the local first hop and the model together")
    ap.add_argument("--rtt-ms", type=float, default=0.5, help="p99 round trip of one remote call")
    ap.add_argument("--request-ids", type=int, default=48, help="ids per request (workload b)")
    ap.add_argument("--out", help="result file (default bench/results/partition_plan_<date>.json)")
    return ap.parse_args(argv)


def host_bytes(args: argparse.Namespace, run: dict, hot_fraction: float) -> dict[str, float]:
    """Bytes one host holds for its partition (the most loaded one: balance factors applied)."""
    parts, n, e = run["parts"], args.nodes, args.edges
    owned = n / parts * run["node_balance"]
    row = 4 * args.features
    hot_rows = hot_fraction * n
    out = {"csc_indptr": (owned + 1) * 8, "csc_indices": e / parts * run["edge_balance"] * 8,
           "global_ids": owned * 8, "features": owned * row,
           "book": n * (4 + 8), "hot_rows": hot_rows * (row + ID_BYTES)}
    out["total"] = sum(out.values())
    return out


def request_bytes(measured: dict, features: int) -> dict[str, float]:
    """A measured request's remote bytes with the plan's feature width: sampling bytes as
    measured (ids only), feature rows re-priced at ``4 * features`` bytes each."""
    rows = measured["remote_rows"]
    return {"sample": measured["sample_bytes"], "features": rows * (ID_BYTES + 4 * features),
            "total": measured["sample_bytes"] + rows * (ID_BYTES + 4 * features),
            "remote_rows": rows, "sampled_nodes": measured["nodes"]}


def per_link(args: argparse.Namespace, single: dict) -> dict[str, Any]:
    """Per link speed: network ms of a single-id request and of a workload-(b) request, seeds/s
    one host's link carries, and the largest batch each remote step fits in its budget. Seeds
    are priced as single ids: on a billion nodes the seeds of one batch share almost no
    neighbours (the measured graph's batches share some, ``batch_per_seed``)."""
    step_ms = (args.p99_ms - args.local_ms) / 2
    out = {}
    for gbit in args.links_gbit:
        rate = gbit * GBIT
        out[f"{gbit:g}Gb"] = {
            "single_ms": single["total"] / rate * 1e3,
            "request_b_ms": args.request_ids * single["total"] / rate * 1e3,
            "host_seeds_per_s": rate / single["total"],
            "batch_seeds_hop2": (step_ms - args.rtt_ms) / 1e3 * rate / max(single["sample"], 1),
            "batch_seeds_gather": (step_ms - args.rtt_ms) / 1e3 * rate
            / max(single["features"], 1)}
    return out


def plan_run(args: argparse.Namespace, run: dict, hot_fraction: float,
             batch_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"method": run["method"], "parts": run["parts"],
                           "edge_cut_fraction": run["edge_cut_fraction"]}
    for key, hot in (("no_hot", 0.0), ("hot", hot_fraction)):
        traffic = run[f"traffic_{key}"]
        single = request_bytes(traffic["single"], args.features)
        batch = request_bytes(traffic["batch"], args.features)
        batch_seed = {k: v / batch_size for k, v in batch.items()}
        out[key] = {"host_bytes": host_bytes(args, run, hot), "single": single,
                    "batch_per_seed": batch_seed, "links": per_link(args, single)}
    return out


def table(plans: list[dict]) -> str:
    """The decision record's table (markdown)."""
    rows = ["| method | P | cut | replicated | GB per host (CSC / features / book / hot / total) "
            "| remote KB per single id (sampling + rows) | per seed in a measured batch | "
            "25 Gb/s: single-id ms, (b) ms, host seeds/s | 100 Gb/s: the same |",
            "|---" * 9 + "|"]
    for p in plans:
        for key in ("no_hot", "hot"):
            h = p[key]["host_bytes"]
            gb = " / ".join(f"{v / 1e9:.1f}" for v in (
                h["csc_indptr"] + h["csc_indices"] + h["global_ids"], h["features"], h["book"],
                h["hot_rows"], h["total"]))
            links = p[key]["links"]
            rows.append(
                f"| {p['method']} | {p['parts']} | {p['edge_cut_fraction']:.3f} | "
                f"{'yes' if key == 'hot' else 'no'} | {gb} | "
                f"{p[key]['single']['sample'] / 1e3:.2f} + "
                f"{p[key]['single']['features'] / 1e3:.1f} | "
                f"{p[key]['batch_per_seed']['total'] / 1e3:.1f} KB | "
                + " | ".join(f"{links[k]['single_ms']:.3f}, {links[k]['request_b_ms']:.2f}, "
                             f"{links[k]['host_seeds_per_s']:,.0f}" for k in links) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cut = json.loads(Path(args.cut).read_text())
    batch_size = int(cut["meta"].get("batch_size") or 1024)
    plans = [plan_run(args, run, cut["hot_fraction"], batch_size) for run in cut["runs"]]
    print(table(plans))
    for p in plans:
        for gbit, link in p["hot"]["links"].items():
            print(f"{p['method']} P={p['parts']} {gbit} (replicated rows): the largest batch "
                  f"within the p99 share: hop 2 {link['batch_seeds_hop2']:,.0f} seeds, gather "
                  f"{link['batch_seeds_gather']:,.0f} seeds")
    result = {"meta": run_meta(args, cut=str(args.cut), cut_graph=cut["meta"].get("graph")),
              "assumptions": {k: getattr(args, k) for k in (
                  "nodes", "edges", "features", "links_gbit", "p99_ms", "local_ms", "rtt_ms",
                  "request_ids")},
              "hot_fraction": cut["hot_fraction"], "plans": plans, "table": table(plans)}
    date = time.strftime("%Y-%m-%d", time.gmtime())
    write_result(args.out or f"bench/results/partition_plan_{date}.json", result)


if __name__ == "__main__":
    main()
