#!/usr/bin/env python
"""Exact requests on a partitioned graph from the partition servers' exact tables against the
same deployment computing them on the fly (docs/decisions/0065-partition-exact-table.md), in
one run, loaded from outside by the project's generator (``loadtest/gen.py``).

1. A synthetic graph (``--preset`` x ``--scale``), saved, partitioned in two
   (``python -m quiver_serve.partition``).
2. ``table``: ``python -m quiver_serve.scaleout.ray_serve --partitions 2`` with
   ``exact.materialize=on``; the seconds until every server's table is fresh (``GET
   /v1/graph``). ``on_the_fly``: the same with ``exact.materialize=off`` (what a partitioned
   deployment did before the tables).
3. Each: exact workload (b) (48 uniform ids) closed loop at ``--callers`` over HTTP npy and
   exact workload (c) (1 id) with one caller; then ``--update-calls`` edge updates (10 pairs,
   sequential, from this process): their latency (the table's marks are in it); then (b) again
   at the highest caller count while the marked rows are refreshed.

    python -m bench.partition.table --scale 0.01 --out-dir D
    python -m bench.partition.table --scale 0.0005 --out-dir D --smoke    # a check, not a figure
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.partition.serve import partition
from loadtest.harness import Daemon, Session, save_graph, serve_config
from loadtest.results import run_meta, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.partition.table",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="papers100m")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=5.0, help="per load point")
    ap.add_argument("--update-calls", type=int, default=200)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, short points: a check")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config overrides, key=value (repeatable)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.callers, args.seconds, args.update_calls = [1, 4], 1.0, 20
        args.sets = ["inference.device=cpu", *args.sets]
    return args


def bench_config(args: argparse.Namespace) -> Any:
    from quiver_serve.config import ServeConfig

    return ServeConfig.default().with_overrides([
        "graph.format=synthetic", f"graph.synthetic_preset={args.preset}",
        f"graph.synthetic_scale={args.scale}", "model.weights=null", *args.sets])


def load(url: str, workload: str, callers: list[int], seconds: float,
         out: Path) -> dict[str, Any]:
    """``loadtest.gen`` exact requests, closed loop over HTTP npy; its results."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "loadtest.gen", "--url", url, "--protocol", "http-npy",
            "--workload", workload, "--exact", "--mode", "closed", "--clients",
            *map(str, callers), "--seconds", str(seconds), "--bounds-ms", "10", "30", "100",
            "--out", str(out)]
    subprocess.run(argv, check=True, timeout=600 + 60 * len(callers))
    result: dict[str, Any] = json.loads((out / "loadgen.json").read_text())["results"]["http-npy"]
    return result


def post_json(url: str, body: dict[str, Any]) -> tuple[int, float]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
        return resp.status, time.perf_counter() - t0


def updates(url: str, num_nodes: int, calls: int) -> dict[str, Any]:
    """``calls`` edge updates of 10 random pairs, one after another: latency percentiles."""
    rng = np.random.default_rng(0)
    lat = []
    for _ in range(calls):
        status, seconds = post_json(url + "/v1/graph/edges",
                                    {"add": rng.integers(0, num_nodes, (10, 2)).tolist()})
        assert status == 200, status
        lat.append(seconds * 1e3)
    q = np.percentile(lat, [50, 99]) if lat else [None, None]
    return {"calls": calls, "p50_ms": float(q[0]), "p99_ms": float(q[1]), "max_ms": max(lat)}


def fresh_s(daemon: Daemon, timeout_s: float) -> float | None:
    """Seconds until every server's table has no stale row (None: no table)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        tables = [s.get("table") for p in daemon.get_json("/v1/graph")["partitions"]
                  for s in p["servers"]]
        if any(t is None for t in tables):
            return None
        if all(t["stale_rows"] == 0 for t in tables):
            return time.perf_counter() - t0
        time.sleep(0.5)
    raise TimeoutError(f"the tables were not fresh within {timeout_s} s")


def run(s: Session, name: str, config: Path, parts: Path, args: argparse.Namespace,
        out_dir: Path) -> dict[str, Any]:
    materialize = "on" if name == "table" else "off"
    daemon = s.own(Daemon(config, log_path=s.folder / f"{name}.log", name=name,
                          env={"QUIVER_SERVE__EXACT__MATERIALIZE": materialize},
                          command=("-m", "quiver_serve.scaleout.ray_serve"),
                          args=["--partitions", "2", "--replicas", "1", "--partition-dir",
                                str(parts), "--start-timeout-s", str(args.start_timeout_s)],
                          ready_timeout_s=args.start_timeout_s, grace_s=40.0))
    daemon.wait_ready(args.start_timeout_s)
    out: dict[str, Any] = {"fresh_after_ready_s": fresh_s(daemon, args.start_timeout_s)}
    num_nodes = int(daemon.get_json("/v1/graph")["num_nodes"])
    out["b"] = load(daemon.url, "b", args.callers, args.seconds, out_dir / f"{name}-b")
    out["c"] = load(daemon.url, "c", [1], args.seconds, out_dir / f"{name}-c")
    out["updates"] = updates(daemon.url, num_nodes, args.update_calls)
    out["b_after_updates"] = load(daemon.url, "b", args.callers[-1:], args.seconds,
                                  out_dir / f"{name}-b-after")
    out["graph"] = daemon.get_json("/v1/graph")
    daemon.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = bench_config(args)
    result: dict[str, Any] = {"meta": run_meta(args, cfg)}
    with Session("qs-partition-table-") as s:
        _, npz = save_graph(cfg, s.folder)
        config = serve_config(cfg, npz, s.folder)
        parts, result["partitioning"] = partition(config, s.folder, 1 << 20)
        for name in ("table", "on_the_fly"):
            result[name] = run(s, name, config, parts, args, out_dir)
    result["skipped"], result["code"] = s.skipped, s.code
    path = write_result(out_dir / "partition_table.json", result, s.folder)
    print_summary(result)
    print(f"wrote {path}")
    return s.code


def print_summary(result: dict[str, Any]) -> None:
    for name in ("table", "on_the_fly"):
        r = result.get(name)
        if not r:
            continue
        points = r["b"]["points"]
        best = max(points, key=lambda p: p.get("seed_nodes_per_s", 0))
        c = r["c"]["points"][0]
        after = r["b_after_updates"]["points"][0]
        print(f"{name}: fresh {r['fresh_after_ready_s']} s after ready; exact (b) "
              f"{best.get('seed_nodes_per_s', 0):,.0f} seeds/s p50 {best.get('p50_ms')} p99 "
              f"{best.get('p99_ms')} ms at {best.get('clients')} callers; (c) p50 "
              f"{c.get('p50_ms')} p99 {c.get('p99_ms')} ms; updates p50 "
              f"{r['updates']['p50_ms']:.2f} p99 {r['updates']['p99_ms']:.2f} ms; (b) after "
              f"updates p50 {after.get('p50_ms')} p99 {after.get('p99_ms')} ms")


if __name__ == "__main__":
    raise SystemExit(main())
