"""Supervision of every child process, and the Supervisor of the engine cores and CPU samplers.

One watch loop (:class:`ChildSet`) keeps every kind of child up: the engine cores and CPU samplers
of :class:`Supervisor` (the daemon's main process) and the HTTP front-ends of
``frontend/frontdoor.py``. Children are spawned (CUDA-safe) with the graph's shared-memory tensors
as arguments, so none copies the graph; each reports ready / failed / heartbeat on its
supervisor's PULL socket (``control.py``).

* A child that was ready and then exits (kill -9 included) is restarted at the same socket
  address (at most once per ``RESTART_BACKOFF_S``), taking a warm standby (``standby.py``) when
  there is one; one that stops beating for ``hang_timeout_s`` after it was ready (a hung CUDA
  call) is killed and restarted too. Clients learn of a lost engine core from their own socket
  and resend what it held.
* A child that dies before it became ready (a module that does not import, a bad config, a GPU
  that is gone) would die again at once: it is restarted after 1, 2, 4, ... s (at most
  ``START_BACKOFF_MAX_S``), and after ``server.start_failure_limit`` such deaths in a row the
  supervisor gives up with one line naming the child and its error, and the daemon exits 1
  (systemd's start limit, Kubernetes' CrashLoopBackOff) instead of restarting it forever.
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
from quiver_serve.engine.core.devices import num_inference_workers
from quiver_serve.engine.procs.control import control_messages
from quiver_serve.engine.procs.engine_proc import engine_core_main
from quiver_serve.engine.procs.graph_owner import GraphOwner
from quiver_serve.engine.procs.process import spawn_context
from quiver_serve.engine.procs.sampler_proc import sampler_main
from quiver_serve.engine.procs.standby import DAEMON_PRELOAD, StandbyPool, wait_primed
from quiver_serve.engine.procs.typed_engine_proc import config_is_typed, typed_engine_main
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import handed
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.graph.typed_writer import TypedGraphWriter
from quiver_serve.graph.writer import GraphWriter
from quiver_serve.wire import RunAddresses

log = logging.getLogger(__name__)

#: a child that was ready is restarted at most once per this long after its last start
RESTART_BACKOFF_S = 1.0
#: the wait before restarting a child that died before it was ready; doubles with each such death
START_BACKOFF_FIRST_S = 1.0
START_BACKOFF_MAX_S = 30.0
#: a ready child silent this long is taken for hung and killed
HANG_TIMEOUT_S = 30.0
#: when a child died without a word, how long its "failed" message may still be on its way
LAST_WORDS_MS = 100
CHECK_S = 0.1


class StartFailed(RuntimeError):
    """A child died ``server.start_failure_limit`` times in a row before it became ready; the
    message is the one line the daemon prints before it exits 1."""


def start_backoff_s(failures: int) -> float:
    """The wait before the restart that follows the ``failures``-th death in a row before ready."""
    return min(START_BACKOFF_FIRST_S * 2.0 ** max(failures - 1, 0), START_BACKOFF_MAX_S)


def exit_reason(exitcode: int | None) -> str:
    """A dead process's exit as words: ``exit code 1``, ``killed by SIGKILL``."""
    if exitcode is None:
        return "exited"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


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
    #: deaths in a row before it became ready (0 again once it reports ready)
    failures: int = 0
    #: what this run of it reported in its "failed" message, or why its spawn was refused
    error: str | None = None
    #: when a dead child is due to be restarted; None while it runs
    restart_at_s: float | None = None

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
        self.ready, self.error, self.restart_at_s = False, None, None

    def died(self, now_s: float, limit: int) -> bool:
        """Count a death (or a refused spawn) and set when to restart; True when it was the
        ``limit``-th in a row before the child became ready: give up."""
        if self.ready:  # it served: restart as soon as the crash-loop guard allows
            self.failures = 0
            self.restart_at_s = max(now_s, self.started_s + RESTART_BACKOFF_S)
        else:
            self.failures += 1
            self.restart_at_s = now_s + start_backoff_s(self.failures)
        self.ready = False
        return self.failures >= limit

    def reason(self) -> str:
        """Why the last run ended: its "failed" message, else its exit code or signal."""
        if self.error:
            return " ".join(self.error.split())  # one line, whatever the exception's text
        return exit_reason(None if self.process is None else self.process.exitcode)

    def give_up_line(self) -> str:
        return (f"quiver-serve: {self.role} {self.index} failed {self.failures} times before it "
                f"became ready: {self.reason()}")

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


def _nothing(*_: Any) -> None:
    return None


class ChildSet:
    """The children of one supervisor and the one watch loop that keeps them up (any role).

    ``control`` is the supervisor's PULL socket (None: nothing to read, as in unit tests);
    ``may_restart`` says whether dead children are restarted now (not while draining);
    ``on_death`` sees each death once; ``on_fatal`` gets the give-up line once."""

    def __init__(self, children: list[Child], control: zmq.Socket | None,
                 standby: StandbyPool | None, start_failure_limit: int,
                 hang_timeout_s: float = HANG_TIMEOUT_S,
                 on_restart: Callable[[str], None] = _nothing,
                 on_death: Callable[[Child], None] = _nothing,
                 may_restart: Callable[[], bool] = lambda: True) -> None:
        self.children = children
        self._by_key = {(c.role, c.index): c for c in children}
        self.control, self.standby = control, standby
        self.limit, self.hang_timeout_s = start_failure_limit, hang_timeout_s
        self.on_restart, self.on_death, self.may_restart = on_restart, on_death, may_restart
        self.on_fatal: Callable[[str], None] = _nothing
        #: sees each child that reports ready (after a restart too)
        self.on_ready: Callable[[Child], None] = _nothing
        #: the give-up line, once a child reached the start-failure limit (nothing restarts then)
        self.fatal: str | None = None

    def all_ready(self) -> bool:
        return all(c.ready for c in self.children)

    def read_control(self, timeout_ms: int) -> list[Child]:
        """Take what the children said; returns those that became ready."""
        became: list[Child] = []
        if self.control is None:
            return became
        for msg in control_messages(self.control, timeout_ms):
            child = self._by_key.get((msg.role, msg.index))
            if child is None or child.pid != msg.pid:
                continue  # from a predecessor that has since been replaced
            child.last_beat_s = time.monotonic()
            if msg.kind == "ready" and not child.ready:
                child.ready, child.failures, child.info = True, 0, dict(msg.info)
                log.info("%s %d ready (pid %s) %s", child.role, child.index, child.pid, child.info)
                became.append(child)
            elif msg.kind == "failed":
                child.error = str(msg.info.get("message"))
                log.error("%s %d (pid %s) failed to start: %s", child.role, child.index,
                          child.pid, child.error)
        return became

    def step(self, timeout_ms: int) -> list[Child]:
        """One turn: read the control line, then kill the hung, note the dead, restart those
        due; returns the children that became ready."""
        became = self.read_control(timeout_ms)
        for child in became:
            self.on_ready(child)
        for child in self.children:
            if self.fatal is None:
                self.check(child, time.monotonic())
        if self.standby is not None:
            self.standby.tick(self.fatal is None and self.may_restart() and self.all_ready())
        return became

    def watch(self, stop: threading.Event, turn_s: float = CHECK_S,
              tick: Callable[[], None] | None = None) -> None:
        """The watch loop, until ``stop``; ``tick`` (the caller's own work each turn) raises
        out of it, a failed supervision step does not."""
        while not stop.is_set():
            try:
                self.step(int(turn_s * 1000))
            except Exception:  # noqa: BLE001 - restarts must outlive any one failure: log, go on
                log.exception("a watch step failed; retrying in %.0f s", RESTART_BACKOFF_S)
                stop.wait(RESTART_BACKOFF_S)
            if tick is not None:
                tick()

    def check(self, child: Child, now_s: float) -> None:
        if child.process is None:
            return  # not started yet
        if child.restart_at_s is None:  # it was running at the last turn
            if child.ready and child.alive() and now_s - child.last_beat_s > self.hang_timeout_s:
                log.error("%s %d (pid %s) sent no heartbeat for %.0f s; killing it", child.role,
                          child.index, child.pid, now_s - child.last_beat_s)
                child.process.kill()
                child.process.join(timeout=2.0)
            if child.alive():
                return
            self.on_death(child)
            if not self.may_restart():
                child.restart_at_s = float("inf")  # draining: it stays down, and is no failure
                return
            self._count_death(child, now_s)
        if self.fatal is None and self.may_restart() and now_s >= child.restart_at_s:
            self._restart(child, now_s)

    def _count_death(self, child: Child, now_s: float) -> None:
        was_ready = child.ready
        if not was_ready and child.error is None:
            self.read_control(LAST_WORDS_MS)  # its "failed" message may still be on the way
        if child.died(now_s, self.limit):
            self._give_up(child)
            return
        log.error("%s %d (pid %s) %s%s; restarting in %.1f s", child.role, child.index,
                  child.pid, "died: " if was_ready else "died before it became ready: ",
                  child.reason(), max(child.restart_at_s - now_s, 0.0))

    def _restart(self, child: Child, now_s: float) -> None:
        try:
            child.start(self.standby)
        except Exception as exc:  # noqa: BLE001 - the OS refused the spawn (no memory, no file
            # descriptors): counted as a death before ready, so it is retried, then given up
            child.error = f"{type(exc).__name__}: {exc}"
            log.error("%s %d: restart refused (%s)", child.role, child.index, child.error)
            if child.died(now_s, self.limit):
                self._give_up(child)
            return
        child.restarts += 1
        self.on_restart(child.role)

    def _give_up(self, child: Child) -> None:
        self.fatal = child.give_up_line()
        self.on_fatal(self.fatal)


class Supervisor:
    """``start()`` brings every child up (raising :class:`StartFailed` with the reason if one
    keeps dying), then a thread keeps them up until ``stop()``. After start-up, a child that
    reaches the start-failure limit sets ``fatal`` and calls ``on_fatal(line)`` (default: log)."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, hang_timeout_s: float = HANG_TIMEOUT_S,
                 on_restart: Callable[[str], None] | None = None, base_version: int = 0,
                 log_dir: str | None = None, typed_graph: TypedGraph | None = None) -> None:
        #: the living graph: update log, writer, compactor, shared counters (``graph_owner.py``);
        #: ``typed_graph``: the typed graph of a typed config, for its writer
        self.owner = GraphOwner(cfg, graph, base_version, log_dir, typed_graph)
        self.cfg, self.graph = cfg, self.owner.graph
        graph = self.graph
        self.living = self.owner.living
        self.graph_state = self.owner.state
        self.on_restart = on_restart or _nothing
        self.on_fatal: Callable[[str], None] = lambda line: log.error("%s", line)
        self.addrs = RunAddresses(tempfile.mkdtemp(prefix="quiver-"))
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.PULL)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(self.addrs.control)
        given = handed(graph)  # a mapped graph goes as its folder: each child maps the files
        # a typed graph's engine cores load it themselves and sample in-process
        # (docs/architecture.md, "Typed graphs")
        typed = config_is_typed(cfg)
        self.samplers = [Child("sampler", j, sampler_main,
                               (j, cfg, given, self.addrs, self.living))
                         for j in range(0 if typed else cfg.sampling.num_cpu_workers)]
        engine_main = typed_engine_main if typed else engine_core_main
        self.engines = [Child("engine", i, engine_main,
                              (i, cfg, given, self.addrs, self.living))
                        for i in range(num_inference_workers(cfg))]
        #: warm processes a restart hands its child's work to (``standby.py``)
        self.standby = StandbyPool(DAEMON_PRELOAD, cfg.server.standby_processes,
                                   "quiver-standby")
        self.kids = ChildSet(self.samplers + self.engines, self._control, self.standby,
                             cfg.server.start_failure_limit, hang_timeout_s,
                             on_restart=lambda role: self.on_restart(role))
        self._started = False
        self.kids.on_fatal = self._on_fatal
        from quiver_serve.engine.procs.model_manager import ModelManager
        from quiver_serve.models.startup import start_plan

        #: the model repository's calls (docs/architecture.md, "Models and versions"); the plan is
        #: checked before any child starts
        self.models = ModelManager(cfg, self.addrs, len(self.engines), start_plan(cfg),
                                   graph.num_features, self._engine_up, self._engine_pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def children(self) -> list[Child]:
        return self.kids.children

    @property
    def fatal(self) -> str | None:
        """The give-up line once a child died ``start_failure_limit`` times before ready."""
        return self.kids.fatal

    def _on_fatal(self, line: str) -> None:
        if self._started:  # during start-up, start() raises it instead
            self.on_fatal(line)

    def start(self) -> None:
        from quiver_serve.metrics.prometheus import multiprocess_dir

        multiprocess_dir()  # before any child starts, so every child inherits it
        self.graph.share_memory_()
        self.owner.open(self._live_readers)
        # An engine core's start needs no sampler (a batch sent early waits in the sampler's
        # queue): engine cores that take the standbys primed as the daemon started
        # (``standby.prime``) go first, and samplers once those standbys' imports are done
        # (``wait_primed``: processes importing at once slow each other); with a core for each
        # starting process all start at once (a restart's seconds); else samplers first, so
        # that they do not share the cores while importing.
        together = bool(self.standby.primed) or \
            (os.cpu_count() or 1) >= len(self.samplers) + len(self.engines) + 2
        if together:
            for child in self.engines:
                child.start(self.standby)
            wait_primed()
            for child in self.samplers:
                child.start()
        for group, what in ((self.samplers, "CPU sampler"), (self.engines, "engine core")):
            if not together:
                for child in group:
                    child.start()
            self._wait_ready(group, what)
        self.standby.trim()
        for child in self.engines:  # they started with the plan, and nothing changed it yet
            self.models.settle(child.index, self._engine_pid(child.index))
        self.models.refresh_dims()
        self.kids.on_ready = self._child_ready
        self._started = True
        self._thread = threading.Thread(target=self.kids.watch, args=(self._stop,),
                                        name="quiver-supervisor", daemon=True)
        self._thread.start()

    def _wait_ready(self, group: list[Child], what: str) -> None:
        """Watch (and restart) every child until ``group`` is ready; StartFailed when one of
        them keeps dying, TimeoutError after ``server.start_timeout_s``."""
        from tqdm import tqdm

        deadline = time.monotonic() + self.cfg.server.start_timeout_s
        with tqdm(total=len(group), desc=f"starting {what}s", unit="proc", leave=False,
                  disable=not group) as bar:
            while not all(c.ready for c in group):
                bar.update(sum(1 for c in self.kids.step(200) if c in group))
                if self.kids.fatal is not None:
                    raise StartFailed(self.kids.fatal)
                if time.monotonic() > deadline:
                    late = [c.index for c in group if not c.ready]
                    raise TimeoutError(f"{what}s {late} not ready after "
                                       f"{self.cfg.server.start_timeout_s:.0f} s")

    @property
    def graph_writer(self) -> GraphWriter | TypedGraphWriter | None:
        """Validates, logs and acknowledges updates (``start()`` opens it); None when another
        daemon holds the update log (this one then serves its graph read-only)."""
        return self.owner.writer

    @property
    def graph_read_only_reason(self) -> str | None:
        return self.owner.read_only_reason

    def _engine_up(self, i: int) -> bool:
        """Engine core ``i`` reported ready and serves the model manager's plan."""
        child = self.engines[i]
        return child.ready and child.alive() and self.models.settled(i, child.pid)

    def _engine_pid(self, i: int) -> int | None:
        child = self.engines[i]
        return child.pid if child.alive() else None

    def _child_ready(self, child: Child) -> None:
        if child.role == "engine":
            self.models.engine_ready(child.index)

    def _live_readers(self) -> list[tuple[str, int]]:
        """(role, index) of every live engine core and CPU sampler (they apply the updates)."""
        return [(c.role, c.index) for c in self.engines + self.samplers if c.alive()]

    def workers(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.children]

    def engines_ready(self) -> bool:
        """At least one engine core is alive, has reported ready since its last (re)start and
        was brought to the model manager's plan since (``ModelManager.settled``)."""
        return any(self._engine_up(c.index) for c in self.engines)

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
        self.models.stop()
        self._ctx.term()
        shutil.rmtree(self.addrs.run_dir, ignore_errors=True)
        self.owner.stop()
