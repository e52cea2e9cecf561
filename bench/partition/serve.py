#!/usr/bin/env python
"""One engine holding the whole graph against the graph in two partitions (one partition server
per GPU), in one run, loaded from outside by the same load generator (``loadtest/gen.py``).

1. The graph (synthetic, papers100M-shaped at ``--scale``) is built once and saved; it is
   partitioned in two (``python -m quiver_serve.partition``: METIS up to
   ``partition.metis_max_edges``, its fallback above; FAP hot rows within
   ``--hot-budget-bytes`` per partition).
2. ``one``: the daemon (``server.py``) on one GPU (``CUDA_VISIBLE_DEVICES=0``; on a CPU box the
   CPU) over the whole graph.
3. ``two-<transport>``: ``python -m quiver_serve.scaleout.ray_serve --partitions 2 --replicas 1``
   over the partitions (a local Ray instance; a GPU per partition server where there are two),
   once per ``--transports`` (``partitioned.transport``: the wire, Ray calls).
4. Each gets workload (b) (48 uniform ids) closed loop at rising callers over HTTP npy, and
   workload (c) (1 id) with one caller: seeds/s at p99 <= each bound, single-id p50. Of ``two``,
   ``/metrics`` gives the remote calls and bytes per request and the replicated-row hit rate.

    python -m bench.partition.serve --scale 0.2 --out-dir D --transports wire ray    # 2 GPUs
    python -m bench.partition.serve --scale 0.0005 --out-dir D --smoke              # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.harness import Daemon, Session, save_graph, serve_config
from loadtest.results import run_meta, write_result

REMOTE = re.compile(r'^quiver_serve_partition_(remote_sent_bytes|remote_received_bytes|'
                    r'remote_calls|rows)_total\{(.*)\} (\S+)$')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.partition.serve",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.2, help="papers100M x this")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, short points: a check, not a figure")
    ap.add_argument("--hot-budget-bytes", type=int, default=1 << 30)
    ap.add_argument("--ingress-replicas", type=int, default=4,
                    help="front-ends of the two-partition runs (ray_serve --ingress-replicas)")
    ap.add_argument("--transports", nargs="+", default=["wire"], choices=["wire", "ray"],
                    help="partitioned.transport of the two-partition runs, one run each")
    ap.add_argument("--callers", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per point")
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 4)))
    ap.add_argument("--start-timeout-s", type=float, default=1800.0)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="section.key=value on the served config (both deployments)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.callers, args.seconds, args.procs, args.ingress_replicas = [1, 4], 1.0, 1, 1
        args.hot_budget_bytes = min(args.hot_budget_bytes, 1 << 20)
        args.sets = ["inference.device=cpu", "server.http_workers=1", *args.sets]
    return args


def bench_config(args: argparse.Namespace) -> Any:
    """The embedded default config on a papers100M-shaped synthetic graph at ``--scale``
    (random weights: the graph's feature width is not Cora's), ``--set`` applied."""
    from quiver_serve.config import ServeConfig

    cfg = ServeConfig.default().with_overrides([
        "graph.format=synthetic", "graph.synthetic_preset=papers100m",
        f"graph.synthetic_scale={args.scale}", "model.weights=null", "exact.materialize=off",
        *args.sets])
    return cfg


def partition(config: Path, folder: Path, hot_budget_bytes: int) -> tuple[Path, dict[str, Any]]:
    """``python -m quiver_serve.partition`` on the served config (its ``partition:`` section:
    METIS up to ``metis_max_edges``, its fallback above), ``hot_budget_bytes`` of hot rows."""
    out = folder / "parts"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "quiver_serve.partition", "--config", str(config),
                    "--parts", "2", "--out", str(out), "--hot-budget-mb",
                    str(hot_budget_bytes / 1e6)], check=True)
    stats = json.loads((out / "stats.json").read_text())
    return out, {"seconds": time.perf_counter() - t0, **stats}


def load(url: str, workload: str, callers: list[int], args: argparse.Namespace,
         out: Path) -> dict[str, Any]:
    """``loadtest.gen`` closed loop over HTTP npy; its summary (seeds/s at each p99 bound)."""
    argv = [sys.executable, "-m", "loadtest.gen", "--url", url, "--protocol", "http-npy",
            "--workload", workload, "--mode", "closed", "--clients", *map(str, callers),
            "--seconds", str(args.seconds), "--procs", str(args.procs), "--bounds-ms", "2",
            "10", "30", "--out", str(out)]
    subprocess.run(argv, check=True, timeout=600 + 60 * len(callers))
    results = json.loads((out / "loadgen.json").read_text())["results"]
    return results["http-npy"]


def remote_per_request(metrics: str, requests: int) -> dict[str, Any]:
    """Remote calls and bytes per answered request, and the replicated-row hit rate."""
    sums: dict[str, float] = {}
    for line in metrics.splitlines():
        m = REMOTE.match(line)
        if m:
            name, labels, value = m.groups()
            key = name if name != "rows" else "rows_" + re.search(r'source="(\w+)"', labels)[1]
            sums[key] = sums.get(key, 0.0) + float(value)
    hot, remote = sums.get("rows_hot", 0.0), sums.get("rows_remote", 0.0)
    per = max(requests, 1)
    return {"remote_calls_per_request": sums.get("remote_calls", 0.0) / per,
            "remote_bytes_per_request": (sums.get("remote_sent_bytes", 0.0)
                                         + sums.get("remote_received_bytes", 0.0)) / per,
            "hot_hit_rate": hot / (hot + remote) if hot + remote else None, "sums": sums}


def run_one(name: str, daemon: Daemon, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    daemon.wait_ready(args.start_timeout_s)
    out: dict[str, Any] = {"b": load(daemon.url, "b", args.callers, args, folder / f"{name}-b"),
                           "c": load(daemon.url, "c", [1], args, folder / f"{name}-c")}
    return out


def run_two(s: Session, config: Path, parts: Path, transport: str, args: argparse.Namespace,
            out_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """The two-partition deployment with ``partitioned.transport`` = ``transport``, loaded as
    ``one``; its remote calls and bytes per request and replicated-row hit rate."""
    import urllib.request

    name = f"two-{transport}"
    two = s.own(Daemon(config, log_path=s.folder / f"{name}.log", name=name,
                       env={**env, "QUIVER_SERVE__PARTITIONED__TRANSPORT": transport},
                       command=("-m", "quiver_serve.scaleout.ray_serve"),
                       args=["--partitions", "2", "--replicas", "1", "--partition-dir",
                             str(parts), "--start-timeout-s", str(args.start_timeout_s),
                             "--ingress-replicas", str(args.ingress_replicas)],
                       ready_timeout_s=args.start_timeout_s, grace_s=40.0))
    out = run_one(name, two, args, out_dir)
    out["graph"] = two.get_json("/v1/graph")
    with urllib.request.urlopen(two.url + "/metrics", timeout=30) as resp:
        out["remote"] = remote_per_request(resp.read().decode(), answered(out))
    two.stop()
    return out


def answered(result: dict[str, Any]) -> int:
    return sum(int(p.get("ok", p.get("requests", 0))) for w in ("b", "c")
               for p in result[w]["points"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = bench_config(args)
    result: dict[str, Any] = {"meta": run_meta(args, cfg)}
    with Session("qs-partition-serve-") as s:
        _, npz = save_graph(cfg, s.folder)
        config = serve_config(cfg, npz, s.folder)
        parts, result["partitioning"] = partition(config, s.folder, args.hot_budget_bytes)
        smoke_env = {"QUIVER_SERVE_DISABLE_CPP": "1"} if args.smoke else {}
        one = s.own(Daemon(config, log_path=s.folder / "one.log", name="one",
                           env={"CUDA_VISIBLE_DEVICES": "0", **smoke_env},
                           ready_timeout_s=args.start_timeout_s))
        result["one"] = run_one("one", one, args, out_dir)
        one.stop()
        for transport in args.transports:
            result[f"two-{transport}"] = run_two(s, config, parts, transport, args, out_dir,
                                                 smoke_env)
    result["skipped"], result["code"] = s.skipped, s.code
    path = write_result(out_dir / "partition_serve.json", result, s.folder)
    print_summary(result)
    print(f"wrote {path}")
    return s.code


def print_summary(result: dict[str, Any]) -> None:
    for name in [k for k in result if k == "one" or k.startswith("two-")]:
        b, c = result[name]["b"]["summary"], result[name]["c"]["points"][0]
        best = b.get("p99<=10ms") or {}
        print(f"{name}: (b) {best.get('seed_nodes_per_s', 0):,.0f} seeds/s at p99 <= 10 ms "
              f"(p99 {best.get('p99_ms')}); (c) single id p50 {c.get('p50_ms')} ms")
    for name in [k for k in result if k.startswith("two-") and "remote" in result[k]]:
        r = result[name]["remote"]
        print(f"{name}: {r['remote_calls_per_request']:.2f} remote calls and "
              f"{r['remote_bytes_per_request']:,.0f} bytes per request; replicated-row hit "
              f"rate {r['hot_hit_rate']}")


if __name__ == "__main__":
    raise SystemExit(main())
