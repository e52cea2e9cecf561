"""The update load of ``bench.graph.updates``: processes posting edge batches to
``POST /v1/graph/edges`` at a target rate, beside (not inside) the load generator's processes.

Each of P spawned processes runs one asyncio loop. A step's total call rate is ``rate /
edges_per_call``; calls are evenly spaced and dealt round-robin (process p sends calls p, p + P,
...), each sent at its scheduled instant whatever is in flight, up to ``inflight`` calls per
process (a call that would pass it is counted as ``skipped``, not sent: the updater never slows
down to the server's pace unnoticed). A call adds random edges (src uniform; dst uniform, or with
probability ``degree_bias`` drawn in proportion to the base in-degree) and removes a share of
edges this process added earlier and saw acknowledged, so the graph's size stays level and every
removal hits a present edge. Only calls scheduled inside the window count; latency is from the
actual send to the answer (``lag`` says how late sends were).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from collections import Counter, deque
from typing import Any

import numpy as np

from loadtest.stats import pooled

EDGES_PATH = "/v1/graph/edges"
START_TIMEOUT_S = 120.0
DRAIN_S = 30.0  # longest a step waits for its last calls after the window


def add_updater_options(ap: argparse.ArgumentParser) -> None:
    """The options of a bench's updater processes: pairs per call, removals, degree bias,
    processes, calls in flight."""
    ap.add_argument("--edges-per-call", type=int, default=2000)
    ap.add_argument("--remove-fraction", type=float, default=0.1,
                    help="share of each call's pairs removing edges added earlier")
    ap.add_argument("--degree-bias", type=float, default=0.5,
                    help="share of added edges whose dst is drawn by in-degree (else uniform)")
    ap.add_argument("--update-procs", type=int, default=2)
    ap.add_argument("--update-inflight", type=int, default=4, help="calls in flight per process")


def draw_adds(rng: np.random.Generator, count: int, num_nodes: int, indptr: np.ndarray,
              degree_bias: float) -> np.ndarray:
    """[count, 2] (src, dst): src uniform; dst uniform, or (probability ``degree_bias``) a node
    drawn in proportion to its in-degree (``indptr``: the base CSC's, cumulative in-degrees)."""
    src = rng.integers(0, num_nodes, count, dtype=np.int64)
    dst = rng.integers(0, num_nodes, count, dtype=np.int64)
    total = int(indptr[-1]) if indptr.size else 0
    biased = rng.random(count) < degree_bias
    if total > 0 and biased.any():
        pos = rng.integers(0, total, int(biased.sum()), dtype=np.int64)
        dst[biased] = np.searchsorted(indptr, pos, side="right") - 1
    return np.stack([src, dst], axis=1)


class Removals:
    """Acknowledged adds of this process, oldest first: the edges its later calls remove."""

    def __init__(self) -> None:
        self.batches: deque[np.ndarray] = deque()
        self.size = 0

    def push(self, pairs: np.ndarray) -> None:
        if len(pairs):
            self.batches.append(pairs)
            self.size += len(pairs)

    def take(self, count: int) -> np.ndarray:
        out: list[np.ndarray] = []
        need = min(count, self.size)
        while need > 0:
            head = self.batches[0]
            if len(head) <= need:
                out.append(self.batches.popleft())
            else:
                out.append(head[:need])
                self.batches[0] = head[need:]
            need -= len(out[-1])
            self.size -= len(out[-1])
        return np.concatenate(out) if out else np.empty((0, 2), np.int64)


def encode(adds: np.ndarray, removes: np.ndarray) -> bytes:
    """The JSON body ``{"add": [[s, d], ...], "remove": [...]}`` (orjson when installed)."""
    try:
        import orjson

        return orjson.dumps({"add": adds, "remove": removes}, option=orjson.OPT_SERIALIZE_NUMPY)
    except ImportError:
        return json.dumps({"add": adds.tolist(), "remove": removes.tolist()}).encode()


class Tally:
    """What one process's calls scheduled inside the window got."""

    def __init__(self) -> None:
        self.lat_s: list[float] = []
        self.lag_s: list[float] = []
        self.status: Counter[str] = Counter()
        self.pairs_ok = self.added = self.removed = self.missing = self.skipped = 0
        self.version = 0

    def record(self, status: str, lat_s: float, lag_s: float, pairs: int, answer: dict) -> None:
        self.status[status] += 1
        self.lag_s.append(lag_s)
        if status == "200":
            self.lat_s.append(lat_s)
            self.pairs_ok += pairs
            self.added += int(answer.get("added", 0))
            self.removed += int(answer.get("removed", 0))
            self.missing += int(answer.get("missing", 0))
            self.version = max(self.version, int(answer.get("version", 0)))

    def result(self, index: int, cpu_frac: float) -> dict[str, Any]:
        return {"index": index, "lat_s": np.asarray(self.lat_s), "lag_s": np.asarray(self.lag_s),
                "status": dict(self.status), "pairs_ok": self.pairs_ok, "added": self.added,
                "removed": self.removed, "missing": self.missing, "skipped": self.skipped,
                "version": self.version, "cpu_frac": cpu_frac}


def schedule(cmd: dict, index: int) -> np.ndarray:
    """Wall-clock send instants of this process's calls, from the start to the window's end."""
    calls_per_s = cmd["rate"] / cmd["edges_per_call"]
    end = cmd["t_start"] + cmd["warm_s"] + cmd["seconds"]
    total = int(np.ceil((end - cmd["t_start"]) * calls_per_s))
    mine = np.arange(index, total, cmd["procs"], dtype=np.float64)
    return cmd["t_start"] + mine / calls_per_s


async def run_updates(index: int, cmd: dict) -> dict[str, Any]:
    """One step in this process (see the module docstring)."""
    import aiohttp

    rng = np.random.default_rng([cmd["seed"], index])
    win0 = cmd["t_start"] + cmd["warm_s"]
    win1 = win0 + cmd["seconds"]
    removals, tally = Removals(), Tally()
    inflight: set[asyncio.Task] = set()
    url = cmd["url"].rstrip("/") + EDGES_PATH
    headers = {"Content-Type": "application/json", **cmd.get("headers", {})}
    n_remove = int(round(cmd["edges_per_call"] * cmd["remove_fraction"]))
    connector = aiohttp.TCPConnector(limit=cmd["inflight"])
    timeout = aiohttp.ClientTimeout(total=cmd["timeout_s"])
    cpu: list[float] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(t_sched: float, body: bytes, adds: np.ndarray, pairs: int) -> None:
            t_send = time.time()
            t0 = time.perf_counter()
            status, answer = await post(session, url, body, headers)
            lat_s = time.perf_counter() - t0
            if status == "200":
                removals.push(adds)
            if win0 <= t_sched < win1:
                tally.record(status, lat_s, t_send - t_sched, pairs, answer)

        for t in schedule(cmd, index).tolist():
            if not cpu and t >= win0:
                cpu.append(time.process_time())
            delay = t - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(inflight) >= cmd["inflight"]:
                tally.skipped += int(win0 <= t < win1)
                continue
            removes = removals.take(n_remove)
            adds = draw_adds(rng, cmd["edges_per_call"] - len(removes), cmd["num_nodes"],
                             cmd["indptr"], cmd["degree_bias"])
            task = asyncio.ensure_future(one(t, encode(adds, removes), adds,
                                             len(adds) + len(removes)))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.sleep(max(0.0, win1 - time.time()))
        cpu.append(time.process_time())
        if inflight:
            await asyncio.wait(list(inflight), timeout=DRAIN_S)
    cpu_frac = (cpu[-1] - cpu[0]) / cmd["seconds"] if len(cpu) == 2 else 0.0
    return tally.result(index, cpu_frac)


async def post(session: Any, url: str, body: bytes, headers: dict) -> tuple[str, dict]:
    """(status, decoded JSON answer or {}); a client failure is a status of its own."""
    try:
        async with session.post(url, data=body, headers=headers) as r:
            raw = await r.read()
            status = str(r.status)
    except asyncio.TimeoutError:
        return "timeout", {}
    except Exception as exc:  # noqa: BLE001 - every failure is counted, by kind
        return f"conn:{type(exc).__name__}", {}
    if status != "200":
        return status, {}
    try:
        return status, json.loads(raw)
    except ValueError:
        return "bad_json", {}


def updater_main(index: int, cmds: Any, out: Any) -> None:
    """An updater process: run each step it is sent until it gets None."""
    out.put({"ready": index})
    while (cmd := cmds.get()) is not None:
        try:
            res = asyncio.run(run_updates(index, cmd))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            res = {"index": index, "failed": f"{type(exc).__name__}: {exc}"}
        out.put(res)


class UpdaterPool:
    """P spawned updater processes kept for a whole run; ``start`` a step, ``collect`` it."""

    def __init__(self, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=updater_main, args=(i, self.cmds[i], self.out),
                                  name=f"updater-{i}", daemon=True) for i in range(procs)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.out.get(timeout=START_TIMEOUT_S)
        self.running: dict | None = None

    def start(self, cmd: dict) -> None:
        """Send every process the step (``cmd``: rate in edge updates/s for all of them)."""
        self.running = cmd
        for q in self.cmds:
            q.put(dict(cmd, procs=len(self.procs)))

    def collect(self) -> dict[str, Any]:
        """The step's merged result (waits for every process)."""
        cmd, self.running = self.running, None
        assert cmd is not None, "collect() without start()"
        wait_s = cmd["t_start"] - time.time() + cmd["warm_s"] + cmd["seconds"] + DRAIN_S + 30
        parts = [self.out.get(timeout=max(wait_s, 1.0)) for _ in self.procs]
        failed = [p["failed"] for p in parts if "failed" in p]
        if failed:
            raise RuntimeError(f"updater process failed: {failed[0]}")
        return merge(parts, cmd)

    def close(self) -> None:
        for q in self.cmds:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def merge(parts: list[dict], cmd: dict) -> dict[str, Any]:
    """One step's update figures from its processes' reports."""
    seconds = cmd["seconds"]
    lat, lag, status = pooled(parts)

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q) * 1e3) if a.size else None

    return {
        "target_edges_per_s": cmd["rate"], "edges_per_call": cmd["edges_per_call"],
        "acked_edges_per_s": sum(p["pairs_ok"] for p in parts) / seconds,
        "calls": sum(status.values()), "calls_ok": status.get("200", 0),
        "status": dict(status), "skipped": sum(p["skipped"] for p in parts),
        "added": sum(p["added"] for p in parts), "removed": sum(p["removed"] for p in parts),
        "missing": sum(p["missing"] for p in parts),
        "call_p50_ms": pct(lat, 50), "call_p99_ms": pct(lat, 99), "call_max_ms": pct(lat, 100),
        "send_lag_p99_ms": pct(lag, 99), "last_version": max((p["version"] for p in parts),
                                                             default=0),
        "updater_cpu_cores": [round(p["cpu_frac"], 3) for p in sorted(parts,
                                                                      key=lambda p: p["index"])],
    }
