"""Supervisor: starts, watches and restarts the engine cores and the CPU sampler pool.

It runs in the daemon's main process. Children are spawned (CUDA-safe) with the graph's
shared-memory tensors as arguments, so none copies the graph. Each reports ready / failed /
heartbeat on one PULL socket. A child that exits (kill -9 included) is restarted at the same socket
address (at most once per ``RESTART_BACKOFF_S``); an engine core that stops beating for
``hang_timeout_s`` after it was ready (a hung CUDA call) is killed and restarted too. Clients learn
of a lost engine core from their own socket and resend what it held.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core_proc import (
    RunAddresses,
    control_messages,
    engine_core_main,
    sampler_main,
)
from quiver_serve.engine.devices import num_inference_workers
from quiver_serve.engine.process import spawn_context
from quiver_serve.engine.standby import DAEMON_PRELOAD, StandbyPool
from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
CHECK_S = 0.1


@dataclass
class Child:
    """One supervised process: how to (re)start it, and what it last said."""

    role: str
    index: int
    target: Callable[..., None]
    args: tuple
    process: Any = None
    restarts: int = 0
    started_s: float = 0.0
    ready: bool = False
    last_beat_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def start(self, standby: StandbyPool | None = None) -> None:
        """Spawn the process, or hand the work to a warm ``standby`` when one is there."""
        name = f"quiver-{self.role}-{self.index}"
        proc = standby.take(self.target, self.args, name) if standby is not None else None
        if proc is None:
            proc = spawn_context().Process(target=self.target, args=self.args, name=name,
                                           daemon=True)
            proc.start()
        self.process = proc
        self.started_s = self.last_beat_s = time.monotonic()
        self.ready = False

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def row(self) -> dict[str, Any]:
        """This child as a ``/v1/workers`` row (``wire.WorkerInfo``)."""
        return {"role": self.role, "index": self.index, "pid": self.pid, "alive": self.alive(),
                "ready": self.ready, "restarts": self.restarts,
                "gc_frozen_objects": self.info.get("gc_frozen_objects")}

    def stop(self, timeout_s: float) -> None:
        if self.process is None:
            return
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=max(timeout_s, 0.1))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=2.0)


class Supervisor:
    """``start()`` brings every child up (raising with the reason if one fails), then a thread
    keeps them up until ``stop()``."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, hang_timeout_s: float = 30.0,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.cfg, self.graph = cfg, graph
        self.hang_timeout_s = hang_timeout_s
        self.on_restart = on_restart or (lambda role: None)
        self.addrs = RunAddresses(tempfile.mkdtemp(prefix="quiver-"))
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.PULL)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(self.addrs.control)
        self.samplers = [Child("sampler", j, sampler_main,
                               (j, cfg, graph.indptr, graph.indices, self.addrs))
                         for j in range(cfg.sampling.num_cpu_workers)]
        self.engines = [Child("engine", i, engine_core_main, (i, cfg, graph, self.addrs))
                        for i in range(num_inference_workers(cfg))]
        #: warm processes a restart hands its child's work to (``engine/standby.py``)
        self.standby = StandbyPool(DAEMON_PRELOAD, cfg.server.standby_processes,
                                   "quiver-standby")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def children(self) -> list[Child]:
        return self.samplers + self.engines

    def start(self) -> None:
        from quiver_serve.metrics import multiprocess_dir

        multiprocess_dir()  # before any child starts, so every child inherits it
        self.graph.share_memory_()
        for group, what in ((self.samplers, "CPU sampler"), (self.engines, "engine core")):
            for child in group:
                child.start()
            self._wait_ready(group, what)
        self._thread = threading.Thread(target=self._watch, name="quiver-supervisor", daemon=True)
        self._thread.start()

    def _wait_ready(self, group: list[Child], what: str) -> None:
        from tqdm import tqdm

        deadline = time.monotonic() + self.cfg.server.start_timeout_s
        with tqdm(total=len(group), desc=f"starting {what}s", unit="proc", leave=False,
                  disable=not group) as bar:
            while not all(c.ready for c in group):
                self._read_control(timeout_ms=200, on_ready=lambda c: bar.update(1))
                for c in group:
                    if not c.ready and not c.alive():
                        raise RuntimeError(f"{what} {c.index} exited during start-up "
                                           f"(code {c.process.exitcode}); see its log above")
                if time.monotonic() > deadline:
                    late = [c.index for c in group if not c.ready]
                    raise TimeoutError(f"{what}s {late} not ready after "
                                       f"{self.cfg.server.start_timeout_s:.0f} s")
        for c in group:
            log.info("%s %d ready (pid %s) %s", what, c.index, c.pid, c.info)

    def _read_control(self, timeout_ms: int, on_ready: Callable[[Child], None] | None = None) -> None:
        for msg in control_messages(self._control, timeout_ms):
            child = self._child(msg.role, msg.index)
            if child is None or child.pid != msg.pid:
                continue  # from a predecessor that has since been replaced
            child.last_beat_s = time.monotonic()
            if msg.kind == "ready":
                child.ready, child.info = True, dict(msg.info)
                if on_ready is not None:
                    on_ready(child)
            elif msg.kind == "failed":
                raise RuntimeError(f"{msg.role} {msg.index} failed to start: "
                                   f"{msg.info.get('message')}")

    def _child(self, role: str, index: int) -> Child | None:
        group = self.engines if role == "engine" else self.samplers
        return group[index] if 0 <= index < len(group) else None

    # ---- watching ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch_once()
            except Exception:  # noqa: BLE001 - restarts must outlive any one failure (a spawn
                # refused for lack of memory or file descriptors, say): log, back off, go on
                log.exception("supervisor: a watch step failed; retrying in %.0f s",
                              RESTART_BACKOFF_S)
                self._stop.wait(RESTART_BACKOFF_S)

    def _watch_once(self) -> None:
        try:
            self._read_control(timeout_ms=int(CHECK_S * 1000))
        except RuntimeError as exc:  # a restarted child failed its start-up: retried below
            log.error("%s", exc)
        if self._stop.is_set():
            return
        for child in self.children:
            self._check(child)
        self.standby.tick(all(c.ready for c in self.children))

    def _check(self, child: Child) -> None:
        now = time.monotonic()
        hung = child.ready and child.alive() and now - child.last_beat_s > self.hang_timeout_s
        if hung:
            log.error("%s %d (pid %s) sent no heartbeat for %.0f s; killing it", child.role,
                      child.index, child.pid, now - child.last_beat_s)
            child.process.kill()
            child.process.join(timeout=2.0)
        if child.alive() or now - child.started_s < RESTART_BACKOFF_S:
            return
        log.error("%s %d (pid %s) died with code %s; restarting", child.role, child.index,
                  child.pid, child.process.exitcode)
        child.restarts += 1
        child.start(self.standby)
        self.on_restart(child.role)

    def workers(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.children]

    def engines_ready(self) -> bool:
        """At least one engine core is alive and has reported ready since its last (re)start."""
        return any(c.ready and c.alive() for c in self.engines)

    def replace_features(self) -> int:
        """Ask every engine core to re-place its feature rows from its request log (SIGUSR1;
        each keeps serving while it rebuilds). Returns how many were asked."""
        asked = 0
        for child in self.engines:
            if child.alive() and child.ready and child.pid is not None:
                os.kill(child.pid, signal.SIGUSR1)
                asked += 1
        return asked

    def engine_info(self, index: int = 0) -> dict[str, Any]:
        return self.engines[index].info

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.standby.stop()
        for child in self.engines + self.samplers:
            child.stop(timeout_s)
        self._control.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self.addrs.run_dir, ignore_errors=True)
