"""Load processes: each runs one asyncio loop with many concurrent callers.

Open loop: one Poisson (or evenly spaced) arrival schedule at the total rate, the same in every
process (same seed); process p sends arrivals p, p + P, ... Latency is measured from the SCHEDULED
send time, so a slow server (or a late sender) shows up in the latency instead of lowering the rate
(no coordinated omission). Closed loop: N callers, each sends its next request when the last one
is answered; latency from the actual send.

Only requests inside the common window [win0, win1) count: open loop, those scheduled in it;
closed loop, those answered in it. Every process reports its own CPU use over the window.

Probes (``cmd["probe"]``): what a bench measures beside the load, inside the load process. The
probe is named by ``{"factory": "package.module:Class", ...options}``, made once per process, and
asked for: ``observer()`` (handed to the queue API's client: the engine's per-batch stats reach
it), ``await window(win0, win1)`` (runs beside the callers from the start instant) and
``report(caller, lat_s, options) -> dict`` (after the point; in the part as ``"probe"``). The
engine-side probe of the daemon benches is ``loadtest/engine_probe.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from loadtest.protocols import OK

Call = Callable[[int], Awaitable[str]]
ERROR_BACKOFF_S = 0.001  # a closed-loop caller whose request failed waits this long (no hot spin)
YIELD_EVERY = 32  # an open-loop sender behind schedule yields to its callers this often
PREPARE_TIMEOUT_S = 120.0  # longest a process may take to connect and encode a point's requests
START_DELAY_S = 0.2  # every process starts this long after the parent sends the start time


def arrival_times(rate_per_s: float, t0: float, t1: float, seed: int,
                  arrivals: str = "poisson") -> np.ndarray:
    """Send times in [t0, t1) of a process of ``rate_per_s`` arrivals per second (all processes)."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0, got {rate_per_s}")
    span = t1 - t0
    if arrivals == "uniform":
        return t0 + np.arange(int(np.ceil(span * rate_per_s))) / rate_per_s
    if arrivals != "poisson":
        raise ValueError(f"arrivals must be poisson or uniform, got {arrivals!r}")
    rng = np.random.default_rng(seed)
    n = int(rate_per_s * span + 6 * np.sqrt(rate_per_s * span) + 16)
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    while times[-1] < span:  # rare: draw more
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate_per_s, n))])
    return t0 + times[times < span]


class Tally:
    """What one process saw in the window: latencies, statuses, seed nodes answered."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes
        self.lat_s: list[float] = []
        self.lag_s: list[float] = []
        self.status: Counter[str] = Counter()
        self.seeds = 0

    def record(self, status: str, latency_s: float, i: int) -> None:
        self.status[status] += 1
        if status == OK:
            self.lat_s.append(latency_s)
            self.seeds += int(self.sizes[i])

    def result(self) -> dict[str, Any]:
        return {"lat_s": np.asarray(self.lat_s, np.float64), "lag_s": np.asarray(self.lag_s),
                "status": dict(self.status), "seeds": self.seeds}


async def open_loop(call: Call, sizes: np.ndarray, times_wall: np.ndarray, win0: float, win1: float,
                    max_inflight: int, drain_s: float) -> dict[str, Any]:
    """Send request ``j % len(sizes)`` at ``times_wall[j]`` (wall clock), whatever is in flight."""
    off = time.time() - time.perf_counter()
    sched = np.asarray(times_wall) - off
    w0, w1 = win0 - off, win1 - off
    tally, inflight = Tally(sizes), {}

    async def one(i: int, t: float) -> None:
        status = await call(i)
        if w0 <= t < w1:
            tally.record(status, time.perf_counter() - t, i)

    n = len(sizes)
    for j, t in enumerate(sched.tolist()):
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif j % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        if len(inflight) >= max_inflight:
            if w0 <= t < w1:
                tally.status["client_overload"] += 1
            continue
        if w0 <= t < w1:
            tally.lag_s.append(time.perf_counter() - t)
        task = asyncio.ensure_future(one(j % n, t))
        inflight[task] = t
        task.add_done_callback(inflight.pop)
    if inflight:
        _, pending = await asyncio.wait(list(inflight), timeout=drain_s)
        for task in pending:
            if w0 <= inflight.get(task, -1.0) < w1:
                tally.status["timeout"] += 1
            task.cancel()
    return tally.result()


async def closed_loop(call: Call, sizes: np.ndarray, callers: int, win0: float,
                      win1: float) -> dict[str, Any]:
    """``callers`` callers; request indices are handed out in order (0, 1, 2, ... cycling)."""
    off = time.time() - time.perf_counter()
    w0, w1 = win0 - off, win1 - off
    tally, order, n = Tally(sizes), itertools.count(), len(sizes)

    async def caller() -> None:
        while (t0 := time.perf_counter()) < w1:
            i = next(order) % n
            status = await call(i)
            done = time.perf_counter()
            if w0 <= done < w1:
                tally.record(status, done - t0, i)
            if status != OK:
                await asyncio.sleep(ERROR_BACKOFF_S)

    await asyncio.gather(*[caller() for _ in range(callers)])
    return tally.result()


_PROBES: dict[str, Any] = {}  # this process's probes, by factory name (kept across points)


def process_probe(spec: dict | None) -> Any:
    """The probe ``spec["factory"]`` names (``module:Class``), made on first use; None: none."""
    if not spec:
        return None
    name = spec["factory"]
    if name not in _PROBES:
        import importlib

        module, _, attr = name.partition(":")
        _PROBES[name] = getattr(importlib.import_module(module), attr)()
    return _PROBES[name]


async def run_point(index: int, procs: int, cmd: dict, cmds: Any, out: Any) -> dict[str, Any]:
    """One point in this process: build the caller (connections, encoded bodies), report
    "prepared", wait for the parent's start time, drive, report."""
    from loadtest.protocols import make_caller
    from loadtest.workloads import process_requests

    reqs = process_requests(cmd["spec"], index, procs)
    probe = process_probe(cmd.get("probe"))
    limit = cmd["max_inflight"] if cmd["mode"] == "open" else max(1, cmd["callers"])
    observer = probe.observer() if probe is not None else None
    exact = bool(cmd["spec"].get("exact", False))
    async with make_caller(cmd["target"], reqs, limit, observer, exact) as caller:
        out.put({"prepared": index})
        go = await asyncio.get_running_loop().run_in_executor(None, cmds.get, True, PREPARE_TIMEOUT_S)
        if "t_start" not in go:
            return {"index": index, "aborted": True}
        res = await drive(caller, reqs, cmd, go["t_start"], index, procs, probe)
    if probe is not None:
        res["probe"] = probe.report(caller, res["lat_s"], cmd["probe"])
    return res


async def drive(caller: Any, reqs: list[np.ndarray], cmd: dict, t_start: float, index: int,
                procs: int, probe: Any) -> dict[str, Any]:
    """From ``t_start``: the callers (open or closed loop), this process's CPU over the window,
    and the probe's own watch."""
    from quiver_serve.engine.procs.heap import collections_paused

    sizes = np.array([r.size for r in reqs], np.int64)
    win0, win1 = t_start + cmd["warm_s"], t_start + cmd["warm_s"] + cmd["seconds"]
    cpu: list[float] = []

    async def cpu_window() -> None:
        await asyncio.sleep(max(0.0, win0 - time.time()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, win1 - time.time()))
        cpu.append(time.process_time())

    await asyncio.sleep(max(0.0, t_start - time.time()))
    watches = [asyncio.ensure_future(cpu_window())]
    if probe is not None:
        watches.append(asyncio.ensure_future(probe.window(win0, win1)))
    with collections_paused():  # this process's own collections are not the server's latency
        if cmd["mode"] == "open":
            times = arrival_times(cmd["rate"], t_start, win1, cmd["seed"], cmd["arrivals"])
            res = await open_loop(caller.call, sizes, times[index::procs], win0, win1,
                                  cmd["max_inflight"], cmd["target"]["timeout_s"])
        else:
            res = await closed_loop(caller.call, sizes, cmd["callers"], win0, win1)
        await asyncio.gather(*watches)
    return {"index": index, **res, "cpu_frac": (cpu[1] - cpu[0]) / cmd["seconds"],
            **caller_counts(caller)}


def caller_counts(caller: Any) -> dict[str, int]:
    """What the caller did beyond the statuses (``retried``: requests sent again after a cut
    connection, HTTP with ``retry_cut``)."""
    return {"retried": caller.retried} if getattr(caller, "retried", None) is not None else {}


def _run(coro_fn: Callable[[], Any], use_uvloop: bool) -> Any:
    """asyncio.run on uvloop when asked and installed (less CPU per request)."""
    if use_uvloop:
        try:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro_fn())
        except (ImportError, AttributeError):  # no uvloop, or Python < 3.11 (no Runner)
            pass
    return asyncio.run(coro_fn())


def load_main(index: int, cmds: Any, out: Any) -> None:
    """A load process: run each point it is sent until it gets None."""
    from loadtest.protocols import QueueCaller
    from quiver_serve.engine.procs.heap import freeze_startup_heap

    freeze_startup_heap(f"loadgen {index}")  # no ~100 ms full collections inside a measurement
    out.put({"ready": index})
    try:
        while (cmd := cmds.get()) is not None:
            try:
                # grpc.aio wants asyncio's own loop; cmd["uvloop"] False: asyncio's (as measured)
                res = _run(lambda c=cmd: run_point(index, c["procs"], c, cmds, out),
                           cmd["target"]["protocol"] != "grpc" and cmd.get("uvloop", True))
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
                res = {"index": index, "failed": f"{type(exc).__name__}: {exc}"}
            out.put(res)
    finally:
        QueueCaller.close_all()


class ProcessPool:
    """P spawned worker processes kept for a whole run (``target(index, cmds, out)``, which says
    ``{"ready": index}`` first); :meth:`run_parts` runs one command split over them."""

    what = "worker process"

    def __init__(self, procs: int, target: Callable[..., None], name: str,
                 start_timeout_s: float = 120.0) -> None:
        if procs < 1:
            raise ValueError(f"{self.what}es must be >= 1, got {procs}")
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=target, name=f"{name}-{i}", daemon=True,
                                  args=(i, self.cmds[i], self.out)) for i in range(procs)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.out.get(timeout=start_timeout_s)

    def run_parts(self, parts: list[dict], run_s: float,
                  on_start: Callable[[float], None] | None = None) -> tuple[float, list[dict]]:
        """Hand process ``i`` ``parts[i]``; once every one has prepared (connected, encoded)
        all start at one wall-clock instant (passed to ``on_start`` first); their reports,
        within ``run_s`` after the start. A failure in any one is raised, naming it."""
        n = len(parts)
        for i, part in enumerate(parts):
            self.cmds[i].put(part)
        ready = [self.out.get(timeout=PREPARE_TIMEOUT_S) for _ in range(n)]
        failed = [m["failed"] for m in ready if "failed" in m]
        if failed:
            prepared = [m["prepared"] for m in ready if "prepared" in m]
            for i in prepared:
                self.cmds[i].put({"abort": True})
            for _ in prepared:
                self.out.get(timeout=PREPARE_TIMEOUT_S)
            raise RuntimeError(f"{self.what} failed: {failed[0]}")
        t_start = time.time() + START_DELAY_S
        if on_start is not None:
            on_start(t_start)
        for i in range(n):
            self.cmds[i].put({"t_start": t_start})
        reports = [self.out.get(timeout=START_DELAY_S + run_s) for _ in range(n)]
        failed = [p["failed"] for p in reports if "failed" in p]
        if failed:
            raise RuntimeError(f"{self.what} failed: {failed[0]}")
        return t_start, reports

    def close(self) -> None:
        close_processes(self.cmds, self.procs)


class LoadPool(ProcessPool):
    """P spawned load processes kept for a whole run; ``run`` measures one point."""

    what = "load process"

    def __init__(self, procs: int, start_timeout_s: float = 120.0) -> None:
        super().__init__(procs, load_main, "loadgen", start_timeout_s)

    def run(self, cmd: dict, on_start: Callable[[float], None] | None = None) -> list[dict]:
        """Run ``cmd`` (mode open: ``rate`` is the total; closed: ``callers`` the total) on the
        processes it needs: each prepares (connects, encodes), then all start at one wall-clock
        instant, passed to ``on_start`` first; returns their reports."""
        n = len(self.procs) if cmd["mode"] == "open" else max(1, min(len(self.procs), cmd["callers"]))
        callers = split_evenly(cmd.get("callers") or 0, n)
        parts = []
        for i in range(n):
            part = dict(cmd, procs=n)
            if cmd["mode"] == "closed":
                part["callers"] = callers[i]
            parts.append(part)
        run_s = cmd["warm_s"] + cmd["seconds"] + cmd["target"]["timeout_s"] + 60
        return self.run_parts(parts, run_s, on_start)[1]


def close_processes(cmds: Sequence[Any], procs: Sequence[Any]) -> None:
    """Ask each load process to end (None on its queue), join it, terminate one that lingers."""
    for q in cmds:
        q.put(None)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def split_evenly(total: int, parts: int) -> Sequence[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
