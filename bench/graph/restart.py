#!/usr/bin/env python
"""A start and a restart after kill -9 (docs/architecture.md, "The living graph": a start is a
map): the daemon's first start on a graph (generated or loaded, then snapshotted), one
acknowledged edge update, kill -9 of the whole daemon, and a start again on the same folders:
seconds to ready each time, the ratio, the snapshot's bytes on disk, and whether the update is
there after the restart (``GET /v1/graph`` version and edge count).

    python -m bench.graph.restart                      # papers100M-shaped, 0.01 (1.1 M nodes)
    python -m bench.graph.restart --scale 0.2          # papers100M x 0.2 (the GPU figure)
    python -m bench.gpu restart                        # the GPU runner's suite
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.harness import Daemon
from loadtest.results import (
    add_run_options,
    doc_parser,
    load_config,
    result_path,
    run_meta,
    write_result,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.graph.restart", __doc__)
    add_run_options(ap, budget_s=900.0, start_timeout_s=900.0)
    ap.add_argument("--preset", default="papers100m")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--device", default="auto", help="inference.device")
    ap.add_argument("--keep", help="state folder to use and keep (default: a temporary one); "
                    "what an earlier run left there is removed first, so the first start is one")
    ap.add_argument("--then-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="after the restart, kill -9 and start once more with these overrides "
                         "(repeatable; e.g. server.start_method=spawn): an A/B on the same state")
    return ap.parse_args(argv)


def set_fields(config: str, sets: list[str]) -> dict[str, object]:
    """``--set`` / ``--then-set`` strings as the daemon's overrides, parsed and checked by
    ``ServeConfig.with_overrides`` (a wrong name or value fails here, naming it)."""
    cfg = load_config(config, sets)
    names = [item.partition("=")[0].strip().split(".") for item in sets]
    return {f"{sec}.{key}": getattr(getattr(cfg, sec), key) for sec, key in names}


def overrides(args: argparse.Namespace, state: Path) -> dict[str, object]:
    return {"graph.format": "synthetic", "graph.path": None, "graph.name": f"{args.preset}-syn",
            "graph.synthetic_preset": args.preset, "graph.synthetic_scale": args.scale,
            "graph.update_log_dir": str(state / "graph"), "graph.fsync": "always",
            "model.weights": None, "inference.device": args.device,
            "server.start_timeout_s": args.start_timeout_s}


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def start(args: argparse.Namespace, state: Path, env: dict[str, str],
          extra: dict[str, object] | None = None) -> tuple[Daemon, float]:
    t0 = time.monotonic()
    d = Daemon(args.config, overrides={**overrides(args, state), **set_fields(args.config, args.sets),
                                       **(extra or {})}, env=env,
               ready_timeout_s=args.start_timeout_s, log_path=state / f"daemon-{t0:.0f}.log")
    d.wait_ready()
    return d, time.monotonic() - t0


#: what a run writes in its state folder: the update log and snapshots, the caches
STATE_PARTS = ("graph", "graphs", "cache")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


#: what the daemon logs after writing a snapshot: the graph's base, the exact table's
WRITTEN = {"graph": re.compile(r"graph snapshot written to \S+: ([\d.]+) GB in ([\d.]+) s"),
           "exact_table": re.compile(r"exact table snapshot at version \d+: ([\d.]+) MiB in "
                                     r"([\d.]+) s")}


def snapshot_writes(log_text: str) -> dict[str, dict[str, float]]:
    """Bytes and seconds of each snapshot the first start wrote, from its log."""
    found = {}
    for what, pattern in WRITTEN.items():
        m = pattern.search(log_text)
        if m:
            size_bytes = float(m.group(1)) * (1e9 if what == "graph" else 2**20)
            found[what] = {"bytes": int(size_bytes), "write_s": float(m.group(2))}
    return found


#: a timestamped line of the daemon's log
STAMPED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:INFO|WARNING) (\S+) (.*)$")


def start_timeline(log_text: str, started_wall_s: float, max_chars: int = 400) -> list[list]:
    """Where a start's seconds went: each timestamped INFO/WARNING line of its log, as
    [seconds after the daemon was launched, process, message]."""
    import datetime as dt

    rows = []
    for line in log_text.splitlines():
        for piece in line.split("\r"):  # progress bars share lines with log records
            m = STAMPED.search(piece)
            if m:
                at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                rows.append([round(at - started_wall_s, 2), m.group(2), m.group(3)[:max_chars]])
    return rows


def kill(d: Daemon) -> None:
    """kill -9 of every process of the daemon: no shutdown."""
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=30)
    d.stop(grace_s=0)


def restart_then(args: argparse.Namespace, state: Path, env: dict[str, str],
                 running: Daemon) -> dict[str, Any]:
    """``--then-set``: kill -9 of ``running``, then a start with those overrides."""
    kill(running)
    wall_s = time.time()
    d, seconds = start(args, state, env, set_fields(args.config, args.then_set))
    timeline = start_timeline(Path(d.log_path).read_text(errors="replace").replace(
        str(state), "<state>"), wall_s)
    d.stop()
    print(f"then with {' '.join(args.then_set)}: ready in {seconds:.1f} s", flush=True)
    return {"sets": args.then_set, "restart_s": round(seconds, 2),
            "engine_built": [t for t in timeline if " built in " in t[2]]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="quiver-restart-"))
    state.mkdir(parents=True, exist_ok=True)
    for left in STATE_PARTS:  # an earlier run's snapshot would make the first start a restart
        shutil.rmtree(state / left, ignore_errors=True)
    env = {"QUIVER_SERVE_GRAPH_STATE": str(state / "graphs"), "QUIVER_SERVE_CACHE": str(state / "cache")}
    try:
        d, first_s = start(args, state, env)
        print(f"first start: ready in {first_s:.1f} s", flush=True)
        writes = snapshot_writes(Path(d.log_path).read_text(errors="replace"))
        ack = post(d.url, "/v1/graph/edges", {"add": [[1, 2], [3, 2]]})
        before = d.get_json("/v1/graph")
        kill(d)
        restart_wall_s = time.time()
        d2, restart_s = start(args, state, env)
        timeline = start_timeline(Path(d2.log_path).read_text(errors="replace").replace(
            str(state), "<state>"), restart_wall_s)  # no machine's folder in a result
        after = d2.get_json("/v1/graph")
        then = restart_then(args, state, env, d2) if args.then_set else None
        if then is None:
            d2.stop()
        kept = after["version"] >= ack["version"] and after["num_edges"] == before["num_edges"]
        row: dict[str, Any] = {
            "first_start_s": round(first_s, 2), "restart_s": round(restart_s, 2),
            "ratio": round(restart_s / first_s, 3), "acked_version": ack["version"],
            "version_after": after["version"], "update_kept": kept,
            "state_bytes": folder_bytes(state / "graph"), "snapshot_writes": writes,
            "num_nodes": after["num_nodes"], "num_edges": after["num_edges"],
            "restart_timeline": timeline}
        if then is not None:
            row["then"] = then
    finally:
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
    print(f"restart: ready in {restart_s:.1f} s ({row['ratio']:.3f} of the first start); "
          f"update kept: {kept}; state on disk {row['state_bytes'] / 1e9:.2f} GB", flush=True)
    write_result(result_path("restart", args),
                 {"meta": run_meta(args, scale=args.scale, preset=args.preset), "result": row},
                 folder=None if args.keep else state)
    return 0 if kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
