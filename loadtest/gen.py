#!/usr/bin/env python
"""Load generator for quiver-serve (and any server of the same /v1/embed or KServe v2 contract).

Several spawned processes, each one asyncio loop with many concurrent callers, so the generator is
not the bottleneck; each reports its own CPU use (cores). Open loop (Poisson arrivals at a total
rate; latency from the scheduled send time: no coordinated omission) or closed loop (N callers).
Protocols: http-json (POST /v1/embed), http-npy (Accept: application/x-npy), kserve-json,
kserve-binary (binary tensor extension, binary_data_output), grpc (KServe v2 ModelInfer over
grpc.aio), grpc-h2 (the same over loadtest/h2_client.py, a lean HTTP/2 client),
grpc-stream (KServe v2 ModelStreamInfer: each process pipelines its callers' requests over up to 8
bidirectional streams, one connection each), grpc-stream-h2 (the same over the lean client), queue (the queue API: starts the daemon in this
process from --config, load processes connect to it).
Workloads (docs/architecture.md, "Performance contract"): a (48 ids from the 1,500-node hot set), b
(48 uniform), c (1 uniform), or trace (an .npy file, one row per request, sent in order; see
loadtest/README.md).

Reports p50/p90/p99/p99.9, req/s, seed nodes/s, errors by status, the per-stage breakdown from the
server's /metrics (histograms differenced over the window), and with --sweep raises the load until
p99 passes --stop-p99-ms: max seed nodes/s at p99 <= each --bounds-ms. JSON and PNGs in --out.

Examples (from the repository root):
    python -m loadtest.gen --url http://127.0.0.1:8000 --protocol http-npy --workload a \\
        --graph-config quiver_serve/defaults/default.yaml --mode closed --clients 1 4 16
    python -m loadtest.gen --protocol http-json http-npy --workload b --mode open --sweep \\
        --start-rate 100 --rate-factor 2 --out bench/results/loadgen
    python -m loadtest.gen --protocol queue --config quiver_serve/defaults/default.yaml --workload c --sweep
    python -m loadtest.gen --protocol grpc --grpc-target 127.0.0.1:8001 --workload trace \\
        --trace trace.npy --mode open --rate 500
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from loadtest import promdiff
from loadtest.driver import LoadPool
from loadtest.protocols import HTTP_CLIENTS, PROTOCOLS
from loadtest.stats import POINT_HEADER, merge_point, point_row, served, summary
from loadtest.workloads import hot_set, load_trace


class Generator:
    """The load processes plus the point / sweep logic; reusable from other scripts."""

    def __init__(self, procs: int, warm_s: float = 0.5, seconds: float = 2.0,
                 max_inflight: int = 4096, arrivals: str = "poisson", seed: int = 0) -> None:
        self.pool = LoadPool(procs)
        self.warm_s, self.seconds = warm_s, seconds
        self.max_inflight, self.arrivals, self.seed = max_inflight, arrivals, seed

    def close(self) -> None:
        self.pool.close()

    def point(self, target: dict, spec: dict, mode: str, level: float,
              metrics: str | None = None,
              on_start: Callable[[float], None] | None = None) -> dict[str, Any]:
        """One measured point; ``metrics``: a base URL to scrape /metrics from, or "local";
        ``on_start(t_start)``: called with the wall-clock instant every process starts at (a
        drill schedules its kills from it)."""
        cmd = {"target": target, "spec": spec, "mode": mode, "warm_s": self.warm_s,
               "seconds": self.seconds, "max_inflight": self.max_inflight,
               "arrivals": self.arrivals, "seed": self.seed,
               "rate": float(level) if mode == "open" else None,
               "callers": int(level) if mode == "closed" else None}
        texts: list[str | None] = []
        threads: list[threading.Thread] = []

        def started(t_start: float) -> None:
            if on_start is not None:
                on_start(t_start)
            if not metrics:
                return
            win0 = t_start + self.warm_s

            def scrape_window() -> None:  # /metrics at both ends of the window
                for t in (win0, win0 + self.seconds):
                    time.sleep(max(0.0, t - time.time()))
                    texts.append(promdiff.local_text() if metrics == "local"
                                 else promdiff.scrape(metrics))

            threads.append(threading.Thread(target=scrape_window, daemon=True))
            threads[0].start()

        parts = self.pool.run(cmd, started)
        point = merge_point(parts, cmd)
        for t in threads:
            t.join(timeout=10)
            if len(texts) == 2 and all(texts):
                point["stages"] = promdiff.breakdown(texts[0], texts[1])  # type: ignore[arg-type]
        return point

    def sweep(self, target: dict, spec: dict, mode: str, levels: list[float], stop_p99_ms: float,
              bounds_ms: list[float], metrics: str | None = None, log: bool = True,
              deadline: float | None = None) -> dict:
        """Points at rising ``levels`` until one is not served at ``stop_p99_ms`` (p99 above it,
        or more than 1% errors), or ``time.perf_counter()`` passes ``deadline``; the summary gives
        max seed nodes/s under each bound."""
        points = []
        for level in levels:
            if deadline is not None and time.perf_counter() > deadline and points:
                print(f"(time budget: sweep stopped before level {level:g})", flush=True)
                break
            p = self.point(target, spec, mode, level, metrics)
            points.append(p)
            if log:
                print(point_row(p), flush=True)
            if not served(p, stop_p99_ms):
                break
        return {"points": points, "summary": summary(points, bounds_ms)}


def add_capacity_options(ap: argparse.ArgumentParser, callers: list[int]) -> None:
    """The options of a bench that measures capacity (closed-loop ``callers`` doubling) and then
    loads the daemon open loop at a fraction of it: ``--ids-per-request``, ``--capacity-*``,
    ``--stop-p99-ms``, ``--load-fraction``."""
    ap.add_argument("--ids-per-request", type=int, default=48)
    ap.add_argument("--capacity-callers", type=int, nargs="+", default=callers)
    ap.add_argument("--capacity-bound-ms", type=float, default=10.0,
                    help="capacity = most req/s at p99 <= this (0: most req/s of any point)")
    ap.add_argument("--capacity-seconds", type=float, default=2.0)
    ap.add_argument("--stop-p99-ms", type=float, default=30.0)
    ap.add_argument("--load-fraction", type=float, default=0.8)


def levels_of(args: argparse.Namespace) -> list[float]:
    """The load levels: given, else geometric (sweep) up to the maximum."""
    if args.mode == "open":
        if args.rate:
            return sorted(args.rate)
        if not args.sweep:
            raise SystemExit("--mode open needs --rate R [R ...] or --sweep")
        out, r = [], args.start_rate
        while r <= args.max_rate:
            out.append(r)
            r *= args.rate_factor
        return out
    if args.clients:
        return sorted(args.clients)
    if not args.sweep:
        return [1]
    out, c = [], 1
    while c <= args.max_clients:
        out.append(c)
        c *= 2
    return out


def probe(url: str, timeout_s: float = 10.0) -> tuple[str | None, int | None]:
    """(model name, node count) from the /v1/embed contract: the answer's "model", and the range
    named in the 400 for an id out of range."""
    import urllib.error
    import urllib.request

    def post(ids: list[int]) -> tuple[int, bytes]:
        req = urllib.request.Request(url.rstrip("/") + "/v1/embed", method="POST",
                                     data=json.dumps({"node_ids": ids}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    try:
        status, body = post([0])
    except OSError as exc:
        raise SystemExit(f"cannot reach {url}/v1/embed: {exc}") from exc
    if status == 503:
        raise SystemExit(f"{url} answered 503 (not ready yet?): {body[:200]!r}")
    model = json.loads(body).get("model") if status == 200 else None
    status, body = post([2**62])
    m = re.search(rb"0\s*\.\.\s*(\d+)", body) if status == 400 else None
    return model, int(m.group(1)) + 1 if m else None


def build_spec(args: argparse.Namespace, num_nodes: int | None, degree: np.ndarray | None) -> dict:
    spec: dict[str, Any] = {"workload": args.workload, "seed": args.seed, "hot": None,
                            "num_nodes": num_nodes, "ids_per_request": args.ids_per_request,
                            "exact": args.exact}
    if args.workload == "trace":
        if not args.trace:
            raise SystemExit("--workload trace needs --trace FILE.npy")
        spec["trace"] = load_trace(args.trace, args.trace_allow_pickle)
        return spec
    if args.workload == "a":
        if args.hot_set:
            spec["hot"] = np.load(args.hot_set, allow_pickle=False).astype(np.int64)
        elif degree is not None:
            spec["hot"] = hot_set(degree)
        else:
            raise SystemExit("workload a needs the hot set: --hot-set FILE.npy or --graph-config")
    elif num_nodes is None:
        raise SystemExit(f"workload {args.workload} needs --num-nodes (or --graph-config)")
    return spec


def check_loopback(url: str, allow_remote: bool) -> None:
    host = urlparse(url if "://" in url else f"//{url}").hostname or ""
    if not allow_remote and not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit(f"refusing to load {host}: loopback targets only (--allow-remote)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m loadtest.gen", description=doc.split("\n\n")[0],
                                 epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    t = ap.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP base URL (loopback)")
    t.add_argument("--grpc-target", default="127.0.0.1:8001", help="host:port of the gRPC endpoint")
    t.add_argument("--protocol", nargs="+", default=["http-json"], choices=PROTOCOLS)
    t.add_argument("--model", help="model name for KServe / gRPC (default: asked from /v1/embed)")
    t.add_argument("--config", help="serve config: --protocol queue starts this daemon in-process")
    t.add_argument("--http-client", default="aiohttp", choices=HTTP_CLIENTS)
    t.add_argument("--timeout-s", type=float, default=10.0, help="client timeout of one request")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    t.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    w = ap.add_argument_group("workload")
    w.add_argument("--workload", default="a", choices=["a", "b", "c", "trace"])
    w.add_argument("--ids-per-request", type=int, help="override 48 (a, b) / 1 (c)")
    w.add_argument("--trace", help="trace .npy (2-D int, rows padded with -1; or 1-D object array)")
    w.add_argument("--trace-allow-pickle", action="store_true",
                   help="read an object-array trace (needs pickle: only files you made)")
    w.add_argument("--num-nodes", type=int, help="ids drawn from [0, N) (b, c); default: asked")
    w.add_argument("--hot-set", help="workload a's hot set, an int .npy (default: from --graph-config)")
    w.add_argument("--graph-config", help="serve config whose graph gives the degrees / node count")
    w.add_argument("--seed", type=int, default=0, help="seed of requests and arrival times")
    w.add_argument("--exact", action="store_true",
                   help="exact requests (every neighbour; the exact table when the daemon has one)")
    lo = ap.add_argument_group("load")
    lo.add_argument("--mode", default="closed", choices=["open", "closed"])
    lo.add_argument("--rate", type=float, nargs="+", help="open loop: total requests/s per point")
    lo.add_argument("--clients", type=int, nargs="+", help="closed loop: total callers per point")
    lo.add_argument("--sweep", action="store_true", help="raise the load until p99 > --stop-p99-ms")
    lo.add_argument("--start-rate", type=float, default=100.0)
    lo.add_argument("--rate-factor", type=float, default=2.0)
    lo.add_argument("--max-rate", type=float, default=1e6)
    lo.add_argument("--max-clients", type=int, default=1024)
    lo.add_argument("--stop-p99-ms", type=float, default=30.0)
    lo.add_argument("--bounds-ms", type=float, nargs="+", default=[10.0, 30.0])
    lo.add_argument("--arrivals", default="poisson", choices=["poisson", "uniform"])
    lo.add_argument("--max-inflight", type=int, default=4096, help="open loop, per process")
    lo.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 4)),
                    help="load processes (default cpus / 4, 1..8)")
    lo.add_argument("--seconds", type=float, default=2.0, help="measured window per point")
    lo.add_argument("--warmup", type=float, default=0.5, help="warm-up before each window")
    ap.add_argument("--out", help="folder for loadgen.json and the PNG plots")
    return ap.parse_args(argv)


def graph_facts(args: argparse.Namespace, pipeline: Any) -> tuple[int | None, np.ndarray | None]:
    """(node count, in-degrees) from the in-process daemon, --graph-config, or nothing."""
    if pipeline is not None:
        return pipeline.graph.num_nodes, pipeline.graph.degree().numpy()
    if args.graph_config:
        from quiver_serve.config import ServeConfig, resolve_path
        from quiver_serve.graph.datasets import load_graph

        g = load_graph(ServeConfig.from_yaml(resolve_path(args.graph_config)).graph)
        return g.num_nodes, g.degree().numpy()
    return args.num_nodes, None


def start_pipeline(config: str) -> Any:
    from quiver_serve.config import ServeConfig, resolve_path
    from quiver_serve.engine.client.pipeline import Pipeline

    return Pipeline(ServeConfig.from_yaml(resolve_path(config))).start()


def run(args: argparse.Namespace) -> dict:
    """Every protocol's sweep (or fixed levels) against one target."""
    http = [p for p in args.protocol if p != "queue"]
    if http:
        check_loopback(args.url, args.allow_remote)
    if any(p.startswith("grpc") for p in args.protocol):
        check_loopback(args.grpc_target, args.allow_remote)
    if "queue" in args.protocol and not args.config:
        raise SystemExit("--protocol queue needs --config (the daemon is started in this process)")
    levels = levels_of(args)
    pipeline = start_pipeline(args.config) if "queue" in args.protocol else None
    gen = None
    try:
        num_nodes, degree = graph_facts(args, pipeline)
        model = args.model
        if http and (model is None or (num_nodes is None and args.workload in "bc")):
            probed_model, probed_nodes = probe(args.url, args.timeout_s)
            model, num_nodes = model or probed_model, num_nodes or probed_nodes
        spec = build_spec(args, num_nodes, degree)
        gen = Generator(args.procs, args.warmup, args.seconds, args.max_inflight, args.arrivals,
                        args.seed)
        results: dict[str, Any] = {}
        print(POINT_HEADER, flush=True)
        for protocol in args.protocol:
            target = {"protocol": protocol, "url": args.url, "grpc_target": args.grpc_target,
                      "model": model or "", "timeout_s": args.timeout_s,
                      "http_client": args.http_client,
                      "endpoints": pipeline.endpoints() if protocol == "queue" else None}
            metrics = None if args.no_metrics else ("local" if protocol == "queue" else args.url)
            stop = args.stop_p99_ms if args.sweep else float("inf")
            results[protocol] = gen.sweep(target, spec, args.mode, levels, stop,
                                          args.bounds_ms, metrics)
        return results
    finally:
        if gen is not None:
            gen.close()
        if pipeline is not None:
            pipeline.stop()


def jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items() if k != "latencies_ms"}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def cdf_point(points: list[dict], bound_ms: float) -> dict | None:
    """The point whose latencies a CDF shows: the best one under the bound, else the first."""
    from loadtest.stats import best_under

    return best_under(points, bound_ms) or (points[0] if points else None)


def report(results: dict, args: argparse.Namespace) -> None:
    """Summary table, stage breakdowns; JSON and plots when --out is given."""
    print("\n| protocol | " + " | ".join(f"max seed nodes/s at p99 <= {b:g} ms"
                                         for b in args.bounds_ms) + " |")
    print("|---|" + "---|" * len(args.bounds_ms))
    for protocol, res in results.items():
        cells = [f"{s['seed_nodes_per_s']:,.0f} (level {s['level']:g}, p99 {s['p99_ms']:.1f})"
                 if s else "none" for s in res["summary"].values()]
        print(f"| {protocol} | " + " | ".join(cells) + " |")
    for protocol, res in results.items():
        last = res["points"][-1] if res["points"] else {}
        if last.get("stages"):
            print(f"\nserver stages over the last {protocol} point ({last['mode']} {last['level']:g}):"
                  "\n| stage | count | mean ms | p50 ms | p99 ms |\n|---|---|---|---|---|")
            print("\n".join(promdiff.stage_rows(last["stages"])))
    if not args.out:
        return
    from loadtest import plots

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadgen.json").write_text(json.dumps(jsonable(
        {"args": vars(args), "results": results}), indent=1) + "\n")
    title = f"workload {args.workload}, {args.mode} loop"
    plots.throughput_vs_p99({k: v["points"] for k, v in results.items()},
                            out / "throughput_vs_p99.png", title, tuple(args.bounds_ms))
    cdfs = {k: p["latencies_ms"] for k, v in results.items()
            if (p := cdf_point(v["points"], max(args.bounds_ms)))}
    plots.latency_cdf(cdfs, out / "latency_cdf.png", title)
    print(f"\nwrote {out / 'loadgen.json'}, throughput_vs_p99.png, latency_cdf.png")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        results = run(args)
    except RuntimeError as exc:  # a load process failed: its message says why
        raise SystemExit(str(exc)) from exc
    report(results, args)


if __name__ == "__main__":
    main()
