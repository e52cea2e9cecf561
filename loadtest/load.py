#!/usr/bin/env python
"""Open-loop HTTP load against a local quiver-serve: prints sent / answered by status / lost.

    python loadtest/load.py --url http://127.0.0.1:8000 --rate 200 --duration-s 30 --nodes 4

Requests leave on a fixed schedule (open loop: a slow server does not slow the sender), each with a
client timeout; a request with no HTTP answer by then counts as lost. Loopback targets only.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--nodes", type=int, default=1, help="node ids per request")
    ap.add_argument("--num-nodes", type=int, default=2708, help="ids are drawn from [0, num_nodes)")
    ap.add_argument("--client-timeout-s", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    host = urlparse(args.url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit(f"refusing to load {host}: loopback targets only")
    print(json.dumps(run(args), indent=2))


def run(args: argparse.Namespace) -> dict[str, object]:
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    client = httpx.Client(base_url=args.url, timeout=args.client_timeout_s,
                          limits=httpx.Limits(max_connections=args.threads))

    def one() -> None:
        ids = [random.randrange(args.num_nodes) for _ in range(args.nodes)]
        t0 = time.perf_counter()
        try:
            status = str(client.post("/v1/embed", json={"node_ids": ids}).status_code)
        except httpx.HTTPError as exc:
            status = f"lost:{type(exc).__name__}"
        with lock:
            statuses[status] += 1
            if status == "200":
                latencies.append(time.perf_counter() - t0)

    total = int(args.rate * args.duration_s)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        for i in range(total):
            delay = start + i / args.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one)
    client.close()
    latencies.sort()
    lost = sum(v for k, v in statuses.items() if k.startswith("lost"))

    def pct(q: float) -> float | None:
        if not latencies:
            return None
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3, 2)

    return {"sent": total, "answered": dict(statuses), "lost": lost,
            "unanswered": total - sum(statuses.values()), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "wall_s": round(time.perf_counter() - start, 2)}


if __name__ == "__main__":
    main()
