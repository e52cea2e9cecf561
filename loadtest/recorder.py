"""Open-loop load that keeps every request: when it was scheduled, when its answer came, its
status, and the model version that answered (``x-model-version`` of an HTTP npy answer).

The load generator (``loadtest/driver.py``) keeps a window's latencies and status counts only; a
model swap needs each answer's completion time and version (the first answer of the new version,
the latency of the requests sent around the swap). The conventions are the generator's, through
its own parts: one arrival schedule at the total rate shared by P spawned processes, process p
sending arrivals p, p + P, ... (``loadtest.driver.arrival_times``); the requests of
``loadtest.workloads.process_requests``; HTTP npy bodies of ``loadtest.protocols.encode_http``;
latency from the SCHEDULED send (no coordinated omission); the process's own garbage collections
paused while it sends.

Statuses are HTTP codes, or one of :data:`NON_HTTP` for a request with no HTTP answer. Times are
wall-clock seconds (``time.time()``) of this machine, comparable across processes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest.driver import (
    PREPARE_TIMEOUT_S,
    YIELD_EVERY,
    ProcessPool,
    arrival_times,
)
from loadtest.stats import percentiles_ms

VERSION_HEADER = "x-model-version"
EMBED_PATH = "/v1/embed"
OK = 200
UNANSWERED, TIMEOUT, CONN_ERROR, CLIENT_OVERLOAD = 0, -1, -2, -3
NON_HTTP = {UNANSWERED: "unanswered", TIMEOUT: "timeout", CONN_ERROR: "conn",
            CLIENT_OVERLOAD: "client_overload"}
NO_VERSION = -1  # an answer without the header (or no answer)


def status_name(code: int) -> str:
    return NON_HTTP.get(code, str(code))


@dataclass
class Records:
    """Every request of one run, all processes merged, in order of schedule."""

    sched: np.ndarray  # scheduled send, wall-clock s
    done: np.ndarray  # answer read (or failure), wall-clock s; NaN: never
    status: np.ndarray  # int32: HTTP status or a NON_HTTP code
    version: np.ndarray  # int32: the answer's x-model-version, NO_VERSION without one
    win0: float  # the measured window (after the warm-up)
    win1: float
    cpu_cores: list[float] = field(default_factory=list)  # each load process's CPU use
    conn_errors: dict[str, int] = field(default_factory=dict)

    @classmethod
    def merge(cls, parts: list[dict], win0: float, win1: float) -> Records:
        cat = {k: np.concatenate([p[k] for p in parts]) for k in ("sched", "done", "status",
                                                                   "version")}
        order = np.argsort(cat["sched"], kind="stable")
        errors: Counter[str] = Counter()
        for p in parts:
            errors.update(p["conn_errors"])
        cores = [round(p["cpu_frac"], 3) for p in sorted(parts, key=lambda p: p["index"])]
        return cls(**{k: v[order] for k, v in cat.items()}, win0=win0, win1=win1,
                   cpu_cores=cores, conn_errors=dict(errors))

    def statuses(self, mask: np.ndarray | None = None) -> dict[str, int]:
        codes, counts = np.unique(self.status if mask is None else self.status[mask],
                                  return_counts=True)
        return {status_name(int(c)): int(n) for c, n in zip(codes, counts, strict=True)}

    def failed(self, mask: np.ndarray | None = None) -> int:
        st = self.status if mask is None else self.status[mask]
        return int((st != OK).sum())

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """The requests scheduled in [t0, t1): counts, statuses, answers by version, served
        req/s and latency percentiles (from the scheduled send) of the 200s."""
        m = (self.sched >= t0) & (self.sched < t1)
        ok = m & (self.status == OK)
        lat = self.done[ok] - self.sched[ok]
        seconds = max(t1 - t0, 1e-9)
        versions, counts = np.unique(self.version[ok], return_counts=True)
        return {"from_s": t0 - self.win0, "seconds": t1 - t0, "requests": int(m.sum()),
                "ok": int(ok.sum()), "failed": self.failed(m), "statuses": self.statuses(m),
                "req_per_s": float(ok.sum()) / seconds,
                "versions": {str(int(v)): int(n) for v, n in zip(versions, counts, strict=True)},
                **percentiles_ms(lat)}

    def answers(self, version: int) -> np.ndarray:
        """Completion times of the 200s that name ``version``, sorted."""
        sel = (self.status == OK) & (self.version == version)
        return np.sort(self.done[sel])


def _run(coro_fn: Callable[[], Any]) -> Any:
    """asyncio.run on uvloop when it is installed (as ``loadtest.driver`` runs its loads)."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro_fn())
    except (ImportError, AttributeError):
        return asyncio.run(coro_fn())


async def send_all(session: Any, url: str, bodies: list[tuple[bytes, dict[str, str]]],
                   times_wall: np.ndarray, max_inflight: int) -> dict[str, Any]:
    """Send request ``j % len(bodies)`` at ``times_wall[j]`` whatever is in flight; keep each
    one's completion time, status and version."""
    n = len(times_wall)
    done = np.full(n, np.nan)
    status = np.full(n, UNANSWERED, np.int32)
    version = np.full(n, NO_VERSION, np.int32)
    conn_errors: Counter[str] = Counter()
    off = time.time() - time.perf_counter()
    inflight: set[asyncio.Future] = set()

    async def one(j: int) -> None:
        body, headers = bodies[j % len(bodies)]
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                status[j] = r.status
                v = r.headers.get(VERSION_HEADER, "")
                version[j] = int(v) if v.isdigit() else NO_VERSION
        except asyncio.TimeoutError:
            status[j] = TIMEOUT
        except Exception as exc:  # noqa: BLE001 - every client failure is counted, by kind
            status[j] = TIMEOUT if "Timeout" in type(exc).__name__ else CONN_ERROR
            conn_errors[type(exc).__name__] += 1
        done[j] = time.perf_counter() + off

    for j, t in enumerate((np.asarray(times_wall) - off).tolist()):
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif j % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        if len(inflight) >= max_inflight:
            status[j] = CLIENT_OVERLOAD
            continue
        task = asyncio.ensure_future(one(j))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    if inflight:
        await asyncio.wait(list(inflight))
    return {"sched": np.asarray(times_wall, np.float64), "done": done, "status": status,
            "version": version, "conn_errors": dict(conn_errors)}


async def record_point(index: int, cmd: dict, cmds: Any, out: Any) -> dict[str, Any]:
    """One run in this process: connect and encode, report "prepared", wait for the start
    instant, send this process's share of the schedule, report every request."""
    import aiohttp

    from loadtest.protocols import encode_http
    from loadtest.workloads import process_requests
    from quiver_serve.engine.procs.heap import collections_paused

    procs = cmd["procs"]
    bodies = [encode_http("http-npy", r) for r in process_requests(cmd["spec"], index, procs)]
    url = cmd["url"].rstrip("/") + EMBED_PATH
    connector = aiohttp.TCPConnector(limit=cmd["max_inflight"])
    timeout = aiohttp.ClientTimeout(total=cmd["timeout_s"])
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        out.put({"prepared": index})
        go = await asyncio.get_running_loop().run_in_executor(None, cmds.get, True,
                                                              PREPARE_TIMEOUT_S)
        if "t_start" not in go:
            return {"index": index, "aborted": True}
        t_start = go["t_start"]
        end = t_start + cmd["warm_s"] + cmd["seconds"]
        times = arrival_times(cmd["rate"], t_start, end, cmd["seed"])[index::procs]
        await asyncio.sleep(max(0.0, t_start - time.time()))
        cpu0, wall0 = time.process_time(), time.time()
        with collections_paused():
            res = await send_all(session, url, bodies, times, cmd["max_inflight"])
        cpu_frac = (time.process_time() - cpu0) / max(time.time() - wall0, 1e-9)
    return {"index": index, **res, "cpu_frac": cpu_frac}


def record_main(index: int, cmds: Any, out: Any) -> None:
    """A recording process: run each command it is sent until it gets None."""
    from quiver_serve.engine.procs.heap import freeze_startup_heap

    freeze_startup_heap(f"recorder {index}")
    out.put({"ready": index})
    while (cmd := cmds.get()) is not None:
        try:
            res = _run(lambda c=cmd: record_point(index, c, cmds, out))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            res = {"index": index, "failed": f"{type(exc).__name__}: {exc}"}
        out.put(res)


class RecorderPool(ProcessPool):
    """P spawned recording processes kept for a whole bench; ``run`` is one open-loop run."""

    what = "recording process"

    def __init__(self, procs: int, start_timeout_s: float = 120.0) -> None:
        super().__init__(procs, record_main, "recorder", start_timeout_s)

    def run(self, url: str, spec: dict, rate: float, warm_s: float, seconds: float,
            timeout_s: float = 10.0, on_start: Callable[[float], None] | None = None,
            seed: int = 0, max_inflight: int = 4096) -> Records:
        """``rate`` requests/s (all processes, Poisson) to ``url``'s /v1/embed for ``warm_s``
        + ``seconds``; every process starts at one instant, passed to ``on_start`` first."""
        cmd = {"url": url, "spec": spec, "rate": float(rate), "warm_s": warm_s,
               "seconds": seconds, "timeout_s": timeout_s, "seed": seed,
               "max_inflight": max_inflight, "procs": len(self.procs)}
        t_start, parts = self.run_parts([cmd] * len(self.procs),
                                        warm_s + seconds + timeout_s + 60, on_start)
        return Records.merge(parts, t_start + warm_s, t_start + warm_s + seconds)
