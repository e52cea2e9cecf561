"""The front door with several HTTP front-end processes (``server.http_workers`` > 1).

The main process is the supervisor: it holds the config, the graph in shared memory, the engine
cores and CPU samplers (:class:`~quiver_serve.engine.pipeline.Pipeline`), and here the HTTP
front-ends. Each front-end is a spawned process (``frontend/frontend_proc.py``) that binds
``server.port`` with ``SO_REUSEPORT`` and is a client of every engine core. The main process:

* holds the port (and the gRPC port) with an unlistened ``SO_REUSEPORT`` socket, so a restarted
  front-end always gets it back and a port of 0 is resolved once for all of them;
* starts the front-ends before loading the graph, so liveness answers during start-up (readiness
  is 503 until the engine cores are up);
* publishes ``wire.FrontDoorState`` (engines ready, draining, the worker list, the engine
  endpoints, the graph's node count, node capacity and acknowledged version) about ten times a
  second;
* answers the front-ends' graph calls with the supervisor's graph writer
  (``engine/procs/graph_service.py``, at ``FrontDoorAddresses.graph``) once the engine cores
  are up;
* restarts a front-end that exits or stops sending heartbeats (kill -9 included), with the
  supervisor's one watch loop (``engine/procs/supervisor.py`` ChildSet: a front-end that keeps
  dying before it listens is retried with back-off, then the daemon exits 1 with one line naming
  it and its error), and on SIGTERM/SIGINT drains them all (each finishes its admitted
  requests, then exits), then stops the engine cores and samplers and exits 0.
"""

from __future__ import annotations

import _thread
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from quiver_serve.config import ServeConfig
from quiver_serve.engine.procs.graph_service import GraphService
from quiver_serve.engine.procs.standby import FRONTEND_PRELOAD, StandbyPool
from quiver_serve.engine.procs.supervisor import Child, ChildSet, StartFailed
from quiver_serve.frontend.listen import check_port_free, reuseport_socket
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import FrontDoorAddresses, FrontDoorState, WorkerInfo, encode

log = logging.getLogger(__name__)

PUBLISH_S = 0.1
HANG_TIMEOUT_S = 30.0


def reserve_ports(cfg: ServeConfig) -> tuple[ServeConfig, list[Any]]:
    """A copy of ``cfg`` with ports of 0 resolved, and the sockets holding them (OSError if a
    port is taken)."""
    cfg = cfg.model_copy(deep=True)
    s = cfg.server
    held = []
    for field in ("port", "grpc_port"):
        port = getattr(s, field)
        if port is None:
            continue
        port = check_port_free(s.host, port)
        held.append(reuseport_socket(s.host, port, listen=False))
        setattr(s, field, port)
    return cfg, held


class FrontDoor:
    """Starts, watches, restarts and drains ``count`` front-end processes."""

    def __init__(self, cfg: ServeConfig, count: int, observer: PipelineObserver | None = None,
                 log_level: str = "info") -> None:
        from quiver_serve.frontend.frontend_proc import frontend_main

        self.cfg, self._held = reserve_ports(cfg)
        self.observer = observer or PipelineObserver()
        self.addrs = FrontDoorAddresses(tempfile.mkdtemp(prefix="quiver-door-"))
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.PULL)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(self.addrs.control)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.addrs.state)
        self.children = [Child("frontend", i, frontend_main,
                               (i, self.cfg, self.addrs.run_dir, log_level)) for i in range(count)]
        #: warm processes a restarted front-end takes (``engine/procs/standby.py``); spawned once
        #: every front-end has been listening for ``standby.SETTLE_S``
        self.standby = StandbyPool(FRONTEND_PRELOAD, self.cfg.server.standby_processes,
                                   "quiver-frontend-standby")
        self.kids = ChildSet(self.children, self._control, self.standby,
                             self.cfg.server.start_failure_limit, HANG_TIMEOUT_S,
                             on_restart=lambda role: self.observer.on_restart(role),
                             on_death=lambda child: _forget_live_gauges(child.pid),
                             may_restart=lambda: not self.draining)
        self.pipeline: Any = None
        #: the graph writer's calls from the front-ends; None until attach(), or without a writer
        self.graph_service: GraphService | None = None
        self.draining = False
        self._stop = threading.Event()
        #: set when the watch thread died of an error: ``run()`` then stops the daemon (exit 1)
        self.watch_failed = False
        self._thread = threading.Thread(target=self._watch, name="quiver-frontdoor", daemon=True)

    def start(self) -> None:
        for child in self.children:
            child.start()
        self._thread.start()
        log.info("%d HTTP front-end processes on %s:%d (SO_REUSEPORT)%s", len(self.children),
                 self.cfg.server.host, self.cfg.server.port,
                 "" if self.cfg.server.grpc_port is None else
                 f"; KServe gRPC on port {self.cfg.server.grpc_port} in each")

    def attach(self, pipeline: Any) -> None:
        """The engine cores are up: front-ends may build their clients and admit requests (and
        call the graph writer, when the supervisor has one)."""
        supervisor = pipeline.supervisor
        writer = getattr(supervisor, "graph_writer", None)
        models = getattr(supervisor, "models", None)
        if (writer is not None or models is not None) and self.graph_service is None:
            self.graph_service = GraphService(
                writer, self.addrs.graph, len(supervisor.engines), models=models,
                read_only_reason=getattr(supervisor, "graph_read_only_reason", None)).start()
        self.pipeline = pipeline

    def begin_drain(self) -> None:
        """Front-ends drain and exit (and are not restarted)."""
        self.draining = True

    def wait_exited(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while any(c.alive() for c in self.children) and time.monotonic() < end:
            time.sleep(0.05)
        return not any(c.alive() for c in self.children)

    def stop(self, timeout_s: float = 2.0) -> None:
        self.draining = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if self.graph_service is not None:
            self.graph_service.stop()
        self.standby.stop()
        for child in self.children:
            child.stop(timeout_s)
        self._control.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()
        for sock in self._held:
            sock.close()
        shutil.rmtree(self.addrs.run_dir, ignore_errors=True)

    def workers(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.children]

    @property
    def fatal(self) -> str | None:
        """The give-up line once a front-end died ``start_failure_limit`` times before ready."""
        return self.kids.fatal

    # ---- the watch thread (owns both sockets) --------------------------------------------------
    def _watch(self) -> None:
        try:
            self.kids.watch(self._stop, PUBLISH_S, tick=self._publish)
        except Exception:  # noqa: BLE001 - without this thread nothing is supervised: stop
            log.exception("front door: the watch thread failed; stopping the daemon")
            self.watch_failed = True

    def _publish(self) -> None:
        try:
            self._pub.send(encode(self._state()), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _state(self) -> FrontDoorState:
        p = self.pipeline
        rows = self.workers() + (p.workers() if p is not None else [])
        workers = [WorkerInfo(**row) for row in rows]
        if p is None or p.supervisor is None:
            return FrontDoorState(False, self.draining, workers)
        writer = getattr(p.supervisor, "graph_writer", None)
        return FrontDoorState(p.engines_ready and not self.draining, self.draining, workers,
                              msgspec.to_builtins(p.endpoints()), p.num_features,
                              p.num_nodes, p.node_capacity,
                              p.graph_version if writer is not None else None,
                              _models_state(p))


def _models_state(pipeline: Any) -> dict[str, Any] | None:
    """The models' published state; None (logged) rather than a failed watch thread."""
    try:
        state: dict[str, Any] | None = pipeline.models_state
        return state
    except Exception:  # noqa: BLE001 - the front-ends keep the last state they had
        log.exception("front door: the models' state could not be read")
        return None


def _forget_live_gauges(pid: int) -> None:
    """A dead front-end's ``pending_requests`` (a live-sum gauge) must leave the total."""
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid)
    except OSError:
        pass


class _StopDuringStart(BaseException):
    """A signal arrived while the engine cores were starting: abandon start-up."""


def run(cfg: ServeConfig, count: int, log_level: str) -> int:
    """The daemon with ``count`` front-end processes; returns the exit code."""
    from quiver_serve.engine.client.pipeline import Pipeline
    from quiver_serve.engine.procs.bytecode import compile_later
    from quiver_serve.metrics.prometheus import Metrics, multiprocess_dir

    multiprocess_dir()  # before any child starts, so every child inherits it
    metrics = Metrics()
    signals: list[int] = []
    got_signal = threading.Event()
    starting = [True]
    fatal: list[str] = []  # the give-up line of a child that kept dying before it was ready

    def on_signal(sig: int, frame: Any) -> None:
        signals.append(sig)
        got_signal.set()
        if starting[0]:
            starting[0] = False
            raise _StopDuringStart

    def on_fatal(line: str) -> None:
        """From a watch thread: wake the main thread as SIGTERM would (also mid start-up)."""
        fatal.append(line)
        _thread.interrupt_main(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        door = FrontDoor(cfg, count, observer=metrics, log_level=log_level)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", cfg.server.host, cfg.server.port, exc)
        return 1
    door.kids.on_fatal = on_fatal
    pipeline = Pipeline(door.cfg, observer=metrics)
    compile_later("main")  # decision 0067: a no-op unless bytecode is kept aside
    failed = _start(door, pipeline, starting, on_fatal, fatal)
    if failed is not None:
        return failed
    while not got_signal.wait(0.5):
        if door.watch_failed:
            _stop_all(door, pipeline)
            return 1
    if fatal:
        _stop_all(door, pipeline)
        return _exit_with(fatal[0])
    return _drain_and_stop(door, pipeline, signals)


def _start(door: FrontDoor, pipeline: Any, starting: list[bool],
           on_fatal: Callable[[str], None], fatal: list[str]) -> int | None:
    """Front-ends, then the engine cores; None once all are up, else the exit code (all
    stopped)."""
    try:
        door.start()
        pipeline.start()
        pipeline.supervisor.on_fatal = on_fatal
        starting[0] = False
        door.attach(pipeline)
        return None
    except _StopDuringStart:
        _stop_all(door, pipeline)
        if fatal:
            return _exit_with(fatal[0])
        log.info("signal during start-up: stopping")
        return 0
    except Exception as exc:  # noqa: BLE001 - reported; everything is stopped
        starting[0] = False
        _stop_all(door, pipeline)
        if isinstance(exc, StartFailed):
            return _exit_with(str(exc))
        log.error("start-up failed, exiting: %s", exc)
        return 1


def _exit_with(line: str) -> int:
    """The daemon's last word when a child gave up: one line on stderr, exit status 1."""
    print(line, file=sys.stderr, flush=True)
    return 1


def _stop_all(door: FrontDoor, pipeline: Any) -> None:
    door.stop(timeout_s=1.0)
    pipeline.stop(drain_timeout_s=0.0)


def _drain_and_stop(door: FrontDoor, pipeline: Any, signals: list[int]) -> int:
    drain_s = door.cfg.server.drain_timeout_s
    log.info("signal %d: draining %d front-end(s) (up to %.0f s)", signals[0], len(door.children),
             drain_s)
    door.begin_drain()
    pipeline.begin_drain()
    end = time.monotonic() + drain_s + 5.0  # admitted requests, then the last connections, exit
    while time.monotonic() < end and len(signals) < 2:
        if door.wait_exited(0.1):
            break
    if len(signals) >= 2:
        log.info("second signal: stopping now")
    door.stop(timeout_s=1.0)
    pipeline.stop(drain_timeout_s=0.0 if len(signals) >= 2 else min(drain_s, 1.0))
    return 0
