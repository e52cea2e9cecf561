"""Warm standby processes: a restart without a fresh interpreter's imports.

A killed engine core, CPU sampler or HTTP front-end is replaced by a new process. Spawned fresh
(CUDA needs spawn, not fork), that process first imports torch and PyG: 2-6 s depending on the
machine (``-X importtime``: torch and PyG's import of ``torch._dynamo`` are most of it), all before
it builds anything, while its requests wait. A kill -9 must not stop the service for more than
5 s, whatever the machine's import time (docs/decisions/0006-warm-standbys.md).

So a supervisor keeps ``server.standby_processes`` spawned processes that have done those imports
and wait on a pipe. A restart hands one of them the dead child's target and arguments (sent
through the pipe with torch's multiprocessing reductions: the graph's shared memory goes by
handle, as when spawning) and a replacement standby is spawned in the background. A standby
that is not warm yet is still used: it runs the target once its imports are done, which is no
later than a fresh spawn would. A standby exits with its parent, or when its pipe closes.

The same mechanism starts the daemon faster (``server.spawn_early``, decision 0066): the command
line primes one standby per engine core before it imports torch (``prime_daemon``), the first
pool of that preload adopts them, and the engine cores' first start takes them.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from quiver_serve.engine.procs.process import parent_alive, spawn_context

log = logging.getLogger(__name__)

#: what an engine core or a CPU sampler imports before it can start
DAEMON_PRELOAD = ("torch", "torch_geometric", "quiver_serve.engine.procs.engine_proc")
#: what an HTTP front-end process imports before it can start
FRONTEND_PRELOAD = ("torch", "fastapi", "uvicorn", "quiver_serve.frontend.frontend_proc")
#: how often a waiting standby checks that its parent is alive
POLL_S = 0.5
#: at most one standby spawned per this many seconds
SPAWN_GAP_S = 1.0
#: standbys are spawned once every child has been ready this long (their imports take a core for
#: 2-6 s: not while the daemon starts, a child restarts, or the first requests arrive)
SETTLE_S = 5.0


#: a start's CPU samplers wait at most this long for the engine cores' primed
#: standbys to finish their imports: on a host whose file reads are slow, processes importing at
#: once slow each other, and the engine cores' imports are what readiness waits for (0067)
PRIMED_GATE_S = 15.0


#: seconds each module of this process's preload took to import, when it was a standby
#: (the engine core logs them: what a start waited on before its build)
PRELOAD_S: dict[str, float] = {}


def standby_main(conn: Any, preload: Sequence[str], imported: Any) -> None:
    """The standby process: import ``preload``, set ``imported`` (an event: it is warm), then
    wait for (target, args, name, environment) and run it."""
    for name in preload:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the target fails the same way and reports it
            # on its control line; a standby that died here would only be respawned
            log.warning("standby: cannot preload %s (%s)", name, exc)
        PRELOAD_S[name] = time.perf_counter() - t0
    imported.set()
    while parent_alive():
        try:
            if not conn.poll(POLL_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the supervisor is gone or closed the pipe
        if msg is None:
            return
        target, args, name, env = msg
        conn.close()
        mp.current_process().name = name
        os.environ.clear()  # the environment of the hand-over, not of this process's spawn
        os.environ.update(env)
        target(*args)
        return


#: standbys spawned as the daemon starts (``prime``), by preload; a supervisor's pool adopts them
_primed: dict[tuple[str, ...], list[tuple[Any, Any]]] = {}
#: every primed standby process (``wait_primed``)
_primed_procs: list[Any] = []


def prime(preload: Sequence[str], count: int, name: str) -> None:
    """Spawn ``count`` standbys importing ``preload`` now, before the daemon loads its graph
    (``server.spawn_early``): the pools created later adopt them, so the first children take
    processes whose imports (torch and PyG: 5-15 s on a loaded or cold host) ran beside the
    daemon's own start-up instead of after it (docs/decisions/0066-early-spawn.md)."""
    waiting = _primed.setdefault(tuple(preload), [])
    for _ in range(max(0, count)):
        waiting.append(_spawn(tuple(preload), f"{name}-{len(waiting)}"))
        _primed_procs.append(waiting[-1][0])


def wait_primed(timeout_s: float = PRIMED_GATE_S) -> float:
    """Wait until every primed standby has finished its imports (or died), at most
    ``timeout_s``; at once when none was primed. Returns the seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    for proc in _primed_procs:
        while not proc.imported.wait(0.02) and proc.is_alive() and time.monotonic() < deadline:
            pass
    return time.monotonic() - t0


def prime_daemon(cfg: Any) -> None:
    """``prime`` for a daemon of ``cfg``: one standby per engine core (one when the count
    comes from the GPUs: torch is not imported yet; a pool trims what its supervisor did not
    take). Only the engine cores: they are what readiness waits for, and on a host whose file
    reads are slow (gVisor: torch 5 s, PyG 10 s cold) a dozen processes importing at once
    slowed each of them more than the overlap gained (docs/decisions/0066-early-spawn.md)."""
    from quiver_serve.metrics.prometheus import multiprocess_dir

    multiprocess_dir()  # the standbys' environment names the metrics folder
    prime(DAEMON_PRELOAD, cfg.inference.num_workers or 1, "quiver-standby")


def _spawn(preload: tuple[str, ...], name: str) -> tuple[Any, Any]:
    """A started standby process (its ``imported`` event set once it is warm) and the parent's
    end of its pipe."""
    ctx = spawn_context()
    ours, theirs = ctx.Pipe()
    imported = ctx.Event()
    proc = ctx.Process(target=standby_main, args=(theirs, preload, imported), name=name,
                       daemon=True)
    proc.imported = imported
    proc.start()
    theirs.close()
    return proc, ours


class StandbyPool:
    """Up to ``size`` warm processes for one supervisor; ``take`` promotes one to a child.
    Used from one thread (the supervisor's watch thread, after start-up)."""

    def __init__(self, preload: Sequence[str], size: int, name: str) -> None:
        self.preload, self.size, self.name = tuple(preload), max(0, int(size)), name
        #: (process, the parent's end of its pipe); the primed ones first (``prime``)
        self._waiting: list[tuple[Any, Any]] = _primed.pop(self.preload, [])
        self.primed = len(self._waiting)  # adopted from ``prime``
        self._spawned_s = -SPAWN_GAP_S  # monotonic time of the last spawn
        self._settled_since: float | None = None  # since when every child has been ready
        self.promoted = 0

    def refill(self) -> None:
        """Spawn a standby if fewer than ``size`` are alive (dead ones are dropped), at most one
        per ``SPAWN_GAP_S``; the supervisors call it at every watch step."""
        self._waiting = [(p, c) for p, c in self._waiting if p.is_alive() or _close(p, c)]
        while len(self._waiting) < self.size:
            if time.monotonic() - self._spawned_s < SPAWN_GAP_S:
                return  # one spawn per gap: standbys that keep dying cannot cause a spawn storm
            self._spawned_s = time.monotonic()
            self._waiting.append(_spawn(self.preload,
                                        f"{self.name}-{self.promoted + len(self._waiting)}"))

    def tick(self, all_ready: bool) -> None:
        """A supervisor's watch step: refill once every child has been ready for ``SETTLE_S``."""
        now = time.monotonic()
        if not all_ready:
            self._settled_since = None
            return
        if self._settled_since is None:
            self._settled_since = now
        if now - self._settled_since >= SETTLE_S:
            self.refill()

    def warm(self) -> int:
        """How many waiting standbys have finished their imports."""
        return sum(1 for p, _ in self._waiting if p.imported.is_set() and p.is_alive())

    def take(self, target: Callable[..., None], args: tuple, name: str) -> Any | None:
        """A live standby now running ``target(*args)``, or None (none left, or the hand-over
        failed: the caller spawns a fresh process)."""
        while self._waiting:
            proc, conn = self._waiting.pop(0)
            if not proc.is_alive():
                _close(proc, conn)
                continue
            try:
                conn.send((target, args, name, dict(os.environ)))
            except (OSError, ValueError) as exc:  # broken pipe, or args that cannot be sent
                log.warning("standby %s refused its hand-over (%s); spawning fresh", proc.pid, exc)
                proc.kill()
                _close(proc, conn)
                continue
            conn.close()
            self.promoted += 1
            return proc
        return None

    def trim(self) -> None:
        """Stop the waiting standbys beyond ``size`` (primed ones the start did not take)."""
        extra, self._waiting = self._waiting[self.size:], self._waiting[:self.size]
        _stop(extra, 2.0)

    def stop(self, timeout_s: float = 2.0) -> None:
        _stop(self._waiting, timeout_s)
        self._waiting = []

    def pids(self) -> list[int]:
        return [p.pid for p, _ in self._waiting if p.is_alive()]


def _stop(waiting: list[tuple[Any, Any]], timeout_s: float) -> None:
    """Tell each waiting standby to exit; kill those that do not within ``timeout_s``."""
    for _, conn in waiting:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
        conn.close()
    for proc, _ in waiting:
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def _close(proc: Any, conn: Any) -> bool:
    """Release a dead standby's pipe and process handle; False (for filters)."""
    try:
        conn.close()
    except OSError:
        pass
    proc.join(timeout=0)
    return False
