#!/usr/bin/env python
"""Fault drill: kill -9 each worker role under load; print sent / answered by status / lost.

    python loadtest/faults.py [--rate 200] [--seconds 30]

Starts the real daemon on a free loopback port, runs the open-loop load of loadtest/load.py, and
kill -9s the CPU sampler at 1/3 of the run and the inference worker at 2/3. Every request must be
answered (200, or 503 if its retry also failed); none may be lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.load import run as run_load  # noqa: E402
from tests.conftest import ServerProcess, free_port  # noqa: E402


def kill_role(url: str, role: str) -> dict[str, object]:
    workers = httpx.get(url + "/v1/workers").json()["workers"]
    victim = next(w for w in workers if w["role"] == role)
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    while time.monotonic() - t0 < 30:
        now = {(w["role"], w["index"]): w for w in httpx.get(url + "/v1/workers").json()["workers"]}
        w = now[(role, victim["index"])]
        if w["pid"] != victim["pid"] and w["alive"]:
            return {"role": role, "old_pid": victim["pid"], "new_pid": w["pid"],
                    "restarted_after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.05)
    return {"role": role, "old_pid": victim["pid"], "restarted_after_s": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    srv = ServerProcess(Path(args.config), free_port(), Path(tempfile.mkdtemp()) / "server.log")
    try:
        srv.wait_ready()
        kills: list[dict[str, object]] = []

        def drill() -> None:
            time.sleep(args.seconds / 3)
            kills.append(kill_role(srv.url, "sampler"))
            time.sleep(args.seconds / 3)
            kills.append(kill_role(srv.url, "inference"))

        t = threading.Thread(target=drill, daemon=True)
        t.start()
        summary = run_load(SimpleNamespace(url=srv.url, rate=args.rate, duration_s=args.seconds, nodes=2,
                                           num_nodes=2708, client_timeout_s=30.0, threads=64))
        t.join(timeout=60)
        summary["kills"] = kills
        metrics = httpx.get(srv.url + "/metrics").text
        summary["worker_restarts_total"] = [ln for ln in metrics.splitlines()
                                            if ln.startswith("quiver_serve_worker_restarts_total")]
        print(json.dumps(summary, indent=2))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
