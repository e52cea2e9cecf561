#!/usr/bin/env python
"""Soak: measure capacity, then hold a load at a fraction of it and watch memory.

    python -m loadtest.soak --minutes 10 --fraction 0.8 [--client wrk|python] [--config ...]

Starts the real daemon on a free loopback port (``loadtest/harness.py``), measures capacity for
20 s, holds ``fraction`` of it for ``minutes``, samples the resident memory of every daemon
process every 10 s, and prints sent / answered by status / lost / p50 / p99 / RSS growth (from
the end of warm-up to the end). ``--client wrk`` (default) paces wrk's connections to the target
rate: a C client leaves the 2 cores to the server. ``--client python`` is the load generator's
driver (``loadtest/driver.py``: 16 closed-loop callers for capacity, then an open loop at the
target rate), which on a 2-core box competes with the server for CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from loadtest.harness import REPO_ROOT as ROOT
from loadtest.harness import Daemon

CAPACITY_S = 20.0  # the capacity measurement
CAPACITY_CALLERS = 16


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


def soak_python(url: str, minutes: float, fraction: float, nodes: int) -> dict[str, Any]:
    """The driver: capacity from closed-loop callers, then an open loop at ``fraction`` of it."""
    from loadtest.gen import Generator, probe
    from loadtest.stats import answered_summary

    _, num_nodes = probe(url)
    spec = {"workload": "b", "hot": None, "num_nodes": num_nodes, "seed": 0,
            "ids_per_request": nodes}
    target = {"protocol": "http-json", "url": url, "model": "", "timeout_s": 30.0}
    gen = Generator(procs=1, warm_s=0.0, seconds=CAPACITY_S)
    try:
        cap = gen.point(target, spec, "closed", CAPACITY_CALLERS)["req_per_s"]
        rate = cap * fraction
        print(f"capacity {cap:.0f} req/s; soaking at {rate:.0f} req/s", flush=True)
        gen.seconds = minutes * 60
        point = gen.point(target, spec, "open", rate)
    finally:
        gen.close()
    return answered_summary(point) | {"client": "python", "capacity_rps": round(cap),
                                      "target_rps": round(rate),
                                      "achieved_rps": round(point["req_per_s"])}


WRK_SCRIPT = ROOT / "loadtest" / "wrk_embed.lua"


def run_wrk(url: str, seconds: float, connections: int, nodes: int, delay_ms: float) -> dict[str, float]:
    """One wrk run (C client: leaves the CPU to the server); parsed into counts and latencies."""
    env = {**os.environ, "QS_NODES": str(nodes), "QS_DELAY_MS": f"{delay_ms:.3f}"}
    out = subprocess.run(
        ["wrk", "-t", "1", "-c", str(connections), "-d", f"{int(seconds)}s", "--timeout", "30s",
         "--latency", "-s", str(WRK_SCRIPT), url],
        capture_output=True, text=True, env=env, timeout=seconds + 120, check=True,
    ).stdout
    return parse_wrk(out)


def parse_wrk(text: str) -> dict[str, float]:
    def ms(value: str) -> float:
        units = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}
        m = re.match(r"([\d.]+)(us|ms|s|m)$", value)
        return float(m.group(1)) * units[m.group(2)] if m else float("nan")

    result: dict[str, float] = {"non_2xx": 0, "socket_errors": 0}
    for line in text.splitlines():
        parts = line.split()
        if line.strip().startswith(("50%", "99%")):
            result[f"p{parts[0].rstrip('%')}_ms"] = ms(parts[1])
        elif "requests in" in line:
            result["requests"] = float(parts[0])
        elif line.startswith("Requests/sec:"):
            result["req_per_s"] = float(parts[1])
        elif line.strip().startswith("Non-2xx"):
            result["non_2xx"] = float(parts[-1])
        elif line.strip().startswith("Socket errors:"):
            result["socket_errors"] = float(sum(int(x.rstrip(",")) for x in parts[3::2]))
    return result


def soak_wrk(url: str, minutes: float, fraction: float, nodes: int) -> dict[str, Any]:
    """Capacity with 16 unpaced connections, then paced connections at ``fraction`` of it."""
    connections = 16
    cap = run_wrk(url, 20, connections, nodes, 0.0)
    target = cap["req_per_s"] * fraction
    # Each connection: request (latency L) then pause d; rate = connections / (L + d).
    delay_ms = max(connections / target * 1e3 - cap["p50_ms"] * fraction, 0.0)
    trial = run_wrk(url, 10, connections, nodes, delay_ms)
    delay_ms *= max(trial["req_per_s"] / target, 0.1)  # one correction step
    print(f"capacity {cap['req_per_s']:.0f} req/s; target {target:.0f}; pause {delay_ms:.2f} ms/conn",
          flush=True)
    soak = run_wrk(url, minutes * 60, connections, nodes, delay_ms)
    return {"client": "wrk", "capacity_rps": round(cap["req_per_s"]), "target_rps": round(target),
            "achieved_rps": round(soak["req_per_s"]),
            "achieved_fraction": round(soak["req_per_s"] / cap["req_per_s"], 3),
            "sent": int(soak["requests"]), "non_2xx": int(soak["non_2xx"]),
            "lost": int(soak["socket_errors"]), "p50_ms": soak.get("p50_ms"), "p99_ms": soak.get("p99_ms")}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "quiver_serve/defaults/default.yaml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--client", choices=["python", "wrk"], default="wrk",
                    help="wrk (C, paced; leaves the CPU to the server) or the load generator (python)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    with Daemon(args.config, name="quiver-serve (soak)") as srv:
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(10.0):
                samples.append((time.monotonic() - t0, rss_mib(srv.group_pids())))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if args.client == "wrk":
            summary = soak_wrk(srv.url, args.minutes, args.fraction, args.nodes)
        else:
            summary = soak_python(srv.url, args.minutes, args.fraction, args.nodes)
        stop.set()
        # growth from the end of warm-up (first 90 s: capacity runs and the first minute) to the end
        warm = next((r for t, r in samples if t >= 90.0), samples[0][1] if samples else 0.0)
        end = samples[-1][1] if samples else 0.0
        summary.update(rss_after_warmup_mib=round(warm, 1), rss_end_mib=round(end, 1),
                       rss_growth_pct=round(100 * (end - warm) / warm, 2) if warm else None,
                       workers=srv.get_json("/v1/workers")["workers"])
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
