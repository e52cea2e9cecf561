"""Supervision: kill -9 of each worker role under load; no request hangs, service resumes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future

import pytest

from quiver_serve import Pipeline
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import EmbedResult
from tests.conftest import small_config, wait_standby_warm

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Load:
    """Closed-loop load from a few threads; records every outcome."""

    def __init__(self, p: Pipeline, threads: int = 4) -> None:
        self.p = p
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.max_wait_s = 0.0
        self.last_ok_s = 0.0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, seed: int) -> None:
        i = seed
        while not self.stop.is_set():
            i += 7
            t0 = time.monotonic()
            try:
                fut: Future[EmbedResult] = self.p.submit(self.p.new_request([i % 2708, (i * 13) % 2708]))
                res = fut.result(timeout=30)  # a hang would surface here, not as a test timeout
                key = "200" if res.ok else str(res.error.status)
            except Exception as exc:  # noqa: BLE001 - admission refusals count as outcomes
                key = getattr(getattr(exc, "info", None), "status", type(exc).__name__)
            with self.lock:
                self.outcomes[str(key)] += 1
                self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)
                if key == "200":
                    self.last_ok_s = time.monotonic()

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


@pytest.mark.parametrize("role", ["sampler", "engine"])
def test_kill_9_worker_under_load(cora: GraphData, role: str) -> None:
    cfg = small_config(model__weights=None, server__request_timeout_s=20.0)
    p = Pipeline(cfg, graph=cora).start()
    try:
        wait_standby_warm(p)  # a restart takes it: no fresh interpreter's imports (2-6 s)
        with Load(p) as load:
            time.sleep(1.0)
            assert p.supervisor is not None
            handle = (p.supervisor.samplers if role == "sampler" else p.supervisor.engines)[0]
            victim = handle.pid
            standbys = p.supervisor.standby.pids()
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            while handle.pid == victim and time.monotonic() - killed_at < 10:
                time.sleep(0.05)
            assert handle.pid != victim, "worker not restarted"
            assert handle.pid in standbys, "the restart did not take the warm standby"
            before = load.outcomes["200"]
            while load.outcomes["200"] == before and time.monotonic() - killed_at < 10:
                time.sleep(0.05)
            resumed_s = load.last_ok_s - killed_at
            time.sleep(0.5)
        print(role, dict(load.outcomes), f"resumed after {resumed_s:.2f} s")
        assert load.outcomes["200"] > before, f"no success after restart: {load.outcomes}"
        assert resumed_s < 5.0, f"service resumed after {resumed_s:.1f} s"
        assert handle.restarts == 1
        assert set(load.outcomes) <= {"200", "503"}, load.outcomes  # retried, or refused; none lost
        assert p.pending_count == 0
    finally:
        p.stop()


def test_kill_9_engine_under_asyncio_load(cora: GraphData) -> None:
    """The same drill for coroutine callers, whose requests ride the event loop's own client
    (``LoopClient``): the engine core's death is seen on the loop, its micro-batches are sent
    again once, nothing hangs, service resumes within 5 s."""
    import asyncio

    cfg = small_config(model__weights=None, server__request_timeout_s=20.0)
    p = Pipeline(cfg, graph=cora).start()
    outcomes: Counter[str] = Counter()
    marks: dict[str, float] = {}

    async def caller(seed: int, until_s: float) -> None:
        i = seed
        while time.monotonic() < until_s:
            i += 7
            try:
                await asyncio.wait_for(p.embed_async([i % 2708, (i * 13) % 2708]), timeout=30)
                key = "200"
                if "killed" in marks and "resumed" not in marks:
                    marks["resumed"] = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - refusals count as outcomes
                key = str(getattr(getattr(exc, "info", None), "status", type(exc).__name__))
            outcomes[key] += 1

    async def drill() -> None:
        wait_standby_warm(p)
        until_s = time.monotonic() + 8.0  # the restart takes 1-5 s; callers keep going past it
        callers = [asyncio.ensure_future(caller(s, until_s)) for s in range(16)]
        await asyncio.sleep(1.0)
        assert p.supervisor is not None
        handle = p.supervisor.engines[0]
        os.kill(handle.pid, signal.SIGKILL)
        marks["killed"] = time.monotonic()
        await asyncio.gather(*callers)

    try:
        asyncio.run(drill())
        print(dict(outcomes), f"resumed after {marks.get('resumed', 0) - marks['killed']:.2f} s")
        assert "resumed" in marks, f"no success after the kill: {outcomes}"
        assert marks["resumed"] - marks["killed"] < 5.0
        assert set(outcomes) <= {"200", "503"}, outcomes  # retried, or refused; none lost or hung
        assert p.pending_count == 0
    finally:
        p.stop()


def test_supervisor_outlives_a_failed_restart(cora: GraphData, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart that fails outright (the OS refuses the spawn: no memory, no descriptors) must
    not kill the supervisor's thread: it logs, backs off and restarts the worker on a later turn."""
    from quiver_serve.engine.procs import supervisor as sup_mod

    monkeypatch.setattr(sup_mod, "RESTART_BACKOFF_S", 0.2)
    p = Pipeline(small_config(model__weights=None), graph=cora).start()
    try:
        assert p.supervisor is not None
        handle = p.supervisor.samplers[0]
        real_start = sup_mod.Child.start
        refused: list[int] = []

        def start_once_refused(self: sup_mod.Child, standby: object = None) -> None:
            if not refused:
                refused.append(1)
                raise OSError(24, "Too many open files")
            real_start(self, standby)

        monkeypatch.setattr(sup_mod.Child, "start", start_once_refused)
        victim = handle.pid
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # 30 s: the restart may take the standby while it still imports, on a loaded 2-core box
        while (handle.pid == victim or not handle.ready) and time.monotonic() - killed_at < 30:
            time.sleep(0.05)
        assert refused, "the refused spawn was never tried"
        assert handle.pid != victim and handle.alive() and handle.ready, "worker not restarted"
        assert p.supervisor._thread is not None and p.supervisor._thread.is_alive()
        assert p.embed([1, 2, 3]).shape[0] == 3
    finally:
        p.stop()
