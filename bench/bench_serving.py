#!/usr/bin/env python
"""Serving benchmark on the embedded default (Cora + GraphSAGE, fanouts [25, 10]).

Reports, in one run:
  * direct      – sampler + model called in this process, no batching, no IPC (the floor)
  * http-seq    – the real daemon, one client, one request at a time: p50/p99 latency
  * http-conc   – the real daemon, N concurrent clients: throughput and p50/p99
  * queue-api   – Pipeline.request_queue()/result_queue(): requests/s and nodes/s

    python bench/bench_serving.py [--requests 500] [--concurrency 16] [--nodes-per-request 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.cli import add_set_option, load_config  # noqa: E402
from quiver_serve import EmbedRequest, Pipeline, ServeConfig  # noqa: E402
from quiver_serve.engine.inference import build_engine  # noqa: E402
from quiver_serve.graph.datasets import load_graph  # noqa: E402
from quiver_serve.messages import BatchedRequest  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(name: str, lat_s: list[float], wall_s: float, nodes: int) -> dict[str, float | str]:
    return {"path": name, "requests": len(lat_s), "p50_ms": pct(lat_s, 0.5) * 1e3,
            "p99_ms": pct(lat_s, 0.99) * 1e3, "req_per_s": len(lat_s) / wall_s,
            "nodes_per_s": nodes / wall_s}


def bench_direct(cfg: ServeConfig, n_req: int, k: int) -> dict[str, float | str]:
    torch.set_num_threads(cfg.inference.torch_threads)
    graph = load_graph(cfg.graph)
    engine = build_engine(cfg, graph, 0)  # GPU sampler and CUDA model when cfg asks for them
    lat = []
    t_all = time.perf_counter()
    for i in range(n_req):
        ids = torch.randint(0, graph.num_nodes, (k,))
        b = BatchedRequest(batch_id=i, request_ids=["r"], offsets=[0, k], node_ids=ids, exact=False,
                           seed=i, deadlines_s=[time.time() + 60])
        t0 = time.perf_counter()
        engine.step(b)
        lat.append(time.perf_counter() - t0)
    return row("direct (in-process floor)", lat, time.perf_counter() - t_all, n_req * k)


def bench_http(cfg_path: Path, n_req: int, k: int, conc: int) -> list[dict[str, float | str]]:
    import httpx  # imported here: the GPU box runs this script with --skip-http and no httpx

    from tests.conftest import ServerProcess, free_port

    srv = ServerProcess(cfg_path, free_port(), Path(tempfile.mkdtemp()) / "server.log")
    try:
        srv.wait_ready()
        rows = []
        for name, workers in (("http-seq", 1), (f"http-conc{conc}", conc)):
            with httpx.Client(base_url=srv.url, timeout=30) as client:
                def one(i: int, c: httpx.Client = client) -> float:
                    ids = torch.randint(0, 2708, (k,)).tolist()
                    t0 = time.perf_counter()
                    r = c.post("/v1/embed", json={"node_ids": ids})
                    assert r.status_code == 200, r.text
                    return time.perf_counter() - t0

                for i in range(50):
                    one(i)  # warm-up
                t_all = time.perf_counter()
                with ThreadPoolExecutor(workers) as pool:
                    lat = list(pool.map(one, range(n_req)))
                rows.append(row(name, lat, time.perf_counter() - t_all, n_req * k))
        return rows
    finally:
        srv.stop()


def bench_queue(cfg: ServeConfig, n_req: int, k: int,
                label: str = "queue-api (all in flight)") -> dict[str, float | str]:
    p = Pipeline(cfg).start()
    try:
        q, r = p.request_queue(), p.result_queue()
        for i in range(50):
            q.put(EmbedRequest(request_id=f"w{i}", node_ids=torch.randint(0, 2708, (k,))))
        for _ in range(50):
            r.get(timeout=30)
        sent: dict[str, float] = {}
        lat = []
        t_all = time.perf_counter()
        for i in range(n_req):
            sent[f"q{i}"] = time.perf_counter()
            q.put(EmbedRequest(request_id=f"q{i}", node_ids=torch.randint(0, 2708, (k,))))
        for _ in range(n_req):
            res = r.get(timeout=60)
            assert res.ok, res.error
            lat.append(time.perf_counter() - sent[res.request_id])
        return row(label, lat, time.perf_counter() - t_all, n_req * k)
    finally:
        p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--nodes-per-request", type=int, default=1)
    ap.add_argument("--skip-http", action="store_true", help="queue API and floor only (no fastapi)")
    ap.add_argument("--gpu", action="store_true", help="inference on CUDA, GPU sampling route")
    ap.add_argument("--json", help="write the rows here")
    add_set_option(ap)
    args = ap.parse_args()
    cfg = load_config(args.config, args.sets)
    if args.gpu:
        cfg.inference.device, cfg.sampling.route = "cuda", "gpu"
    k = args.nodes_per_request
    rows = [bench_direct(cfg, args.requests, k)]
    if not args.skip_http:
        rows += bench_http(Path(args.config).resolve(), args.requests, k, args.concurrency)
    rows.append(bench_queue(cfg, args.requests * 4, k))
    rows.append(bench_queue(cfg, args.requests, 64, label="queue-api, 64 nodes/request"))
    where = "CUDA inference, GPU sampling" if args.gpu else "CPU"
    print(f"\nCora, GraphSAGE, fanouts {cfg.sampling.fanouts}, {k} node(s)/request unless noted, "
          f"{where}, max_delay_ms={cfg.batching.max_delay_ms}, adaptive={cfg.batching.adaptive}")
    print(f"{'path':<32}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>10}{'nodes/s':>11}")
    for r in rows:
        print(f"{r['path']:<32}{r['requests']:>9}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
              f"{r['req_per_s']:>10.0f}{r['nodes_per_s']:>11.0f}")
    if not args.skip_http:
        print(f"http-seq p50 / direct p50 = {rows[1]['p50_ms'] / rows[0]['p50_ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
