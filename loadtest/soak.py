#!/usr/bin/env python
"""Soak: measure capacity, then hold an open-loop load at a fraction of it and watch memory.

    python loadtest/soak.py --minutes 10 --fraction 0.8 [--config configs/default.yaml]

Starts the real daemon on a free loopback port, measures closed-loop capacity for 20 s, runs the
open-loop load (loadtest/load.py) at ``fraction`` of it for ``minutes``, samples the resident
memory of every daemon process, and prints sent / answered by status / lost / p50 / p99 / RSS.
RSS growth is measured from the end of the first minute (warm-up) to the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.load import run as run_load  # noqa: E402
from tests.conftest import ServerProcess, free_port  # noqa: E402


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def capacity_rps(url: str, seconds: float, threads: int, nodes: int) -> float:
    stop = time.monotonic() + seconds
    done = [0]
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while time.monotonic() < stop:
                if c.post("/v1/embed", json={"node_ids": list(range(nodes))}).status_code == 200:
                    with lock:
                        done[0] += 1

    with ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(worker)
    return done[0] / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    srv = ServerProcess(Path(args.config), free_port(), Path(tempfile.mkdtemp()) / "server.log")
    try:
        srv.wait_ready()
        cap = capacity_rps(srv.url, 20.0, 16, args.nodes)
        rate = cap * args.fraction
        print(f"capacity {cap:.0f} req/s; soaking at {rate:.0f} req/s for {args.minutes} min", flush=True)
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(10.0):
                samples.append((time.monotonic() - t0, rss_mib(srv.group_pids())))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        load = SimpleNamespace(url=srv.url, rate=rate, duration_s=args.minutes * 60, nodes=args.nodes,
                               num_nodes=2708, client_timeout_s=30.0, threads=64)
        summary = run_load(load)
        stop.set()
        warm = next((r for t, r in samples if t >= 60.0), samples[0][1] if samples else 0.0)
        end = samples[-1][1] if samples else 0.0
        summary.update(capacity_rps=round(cap), rate_rps=round(rate), rss_after_warmup_mib=round(warm, 1),
                       rss_end_mib=round(end, 1),
                       rss_growth_pct=round(100 * (end - warm) / warm, 2) if warm else None,
                       restarts=httpx.get(srv.url + "/v1/workers").json()["workers"])
        print(json.dumps(summary, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        srv.stop()
        subprocess.run(["true"])


if __name__ == "__main__":
    main()
