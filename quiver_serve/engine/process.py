"""Worker-process plumbing shared by every stage: spawn, readiness, liveness, bounded waits, stop."""

from __future__ import annotations

import logging
import multiprocessing as std_mp
import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.multiprocessing as mp

from quiver_serve.messages import Shutdown, WorkerFailed, WorkerReady

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.05  # how often a blocked loop wakes to check for shutdown or a dead parent
RESTART_BACKOFF_S = 1.0  # a worker is restarted at most this often (crash-loop guard)


def spawn_context() -> Any:
    """Processes that may touch CUDA must be spawned, never forked."""
    return mp.get_context("spawn")


def stop_process_group(proc: Any, grace_s: float) -> None:
    """Stop a ``subprocess.Popen`` started with ``start_new_session=True`` and everything it
    spawned: SIGTERM (the daemon drains), then SIGKILL to the whole group after ``grace_s``."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def parent_alive() -> bool:
    """False once the process that spawned us is gone, so workers never outlive the daemon."""
    parent = std_mp.parent_process()
    return parent is None or parent.is_alive()


def get_or_none(q: Any, timeout_s: float = POLL_S) -> Any:
    """One bounded wait on a queue; ``None`` when nothing came (or the queue was retired)."""
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        return None
    except (EOFError, OSError, ValueError):  # retired queue: writer gone, possibly mid-message
        time.sleep(timeout_s)
        return None


def put_until(q: Any, item: Any, keep_going: Callable[[], bool], poll_s: float = POLL_S) -> bool:
    """Put into a bounded queue, waiting while it is full but only while ``keep_going()``."""
    while True:
        try:
            q.put(item, timeout=poll_s)
            return True
        except queue.Full:
            if not keep_going():
                return False


class WorkerHandle:
    """One worker process of a stage: start, check, restart, stop within a time bound.

    ``make_args`` is called at every (re)start, so a restarted worker gets fresh queues.
    """

    def __init__(self, role: str, index: int, target: Callable[..., None],
                 make_args: Callable[[], tuple]) -> None:
        self.role = role
        self.index = index
        self._target = target
        self._make_args = make_args
        self.process: Any = None
        self.restarts = 0
        self.last_start_s = 0.0

    def start(self) -> None:
        ctx = spawn_context()
        self.process = ctx.Process(
            target=self._target, args=self._make_args(), name=f"quiver-{self.role}-{self.index}",
            daemon=True,
        )
        self.process.start()
        self.last_start_s = time.monotonic()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def died(self) -> bool:
        """Started, and exited without being asked to stop."""
        return self.process is not None and not self.process.is_alive()

    def stop(self, in_queue: Any, timeout_s: float) -> None:
        """Ask politely (a Shutdown message), then terminate, then kill: never waits unbounded."""
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                in_queue.put(Shutdown(), timeout=0.1)
            except (queue.Full, ValueError, OSError):
                pass
            self.process.join(timeout=max(timeout_s, 0.1))
        if self.process.is_alive():
            log.warning("%s-%d did not stop in %.1f s; terminating", self.role, self.index, timeout_s)
            self.process.terminate()
            self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=2.0)


def serve_queue(in_q: Any, out_q: Any, handle: Callable[[Any], list[Any]]) -> None:
    """A worker's loop: each item in, its replies out, until Shutdown or the parent is gone."""
    while parent_alive():
        item = get_or_none(in_q)
        if item is None:
            continue
        if isinstance(item, Shutdown):
            break
        for reply in handle(item):
            put_until(out_q, reply, parent_alive)


def restart_dead(handles: Sequence[WorkerHandle], renew_queues: Callable[[int], None]) -> list[int]:
    """Restart every worker that died (kill -9 included) after giving it fresh queues.

    A dead worker may have held its queues' locks, so ``renew_queues(index)`` must retire them
    (``retire_queue``) and put new ones where the worker's ``make_args`` reads them.
    """
    restarted = []
    for w in handles:
        if not w.died() or time.monotonic() - w.last_start_s < RESTART_BACKOFF_S:
            continue
        log.error("%s %d (pid %s) died with code %s; restarting", w.role, w.index, w.pid,
                  w.process.exitcode)
        renew_queues(w.index)
        w.restarts += 1
        w.start()
        restarted.append(w.index)
    return restarted


def retire_queue(q: Any) -> None:
    """Let go of a dead worker's queue without ever blocking on it.

    Closing our copy of the write end means a reader that meets a message the dead writer left half
    written gets EOFError instead of waiting forever for the rest of it.
    """
    try:
        q.cancel_join_thread()
        writer = getattr(q, "_writer", None)
        if writer is not None:
            writer.close()
    except (OSError, ValueError):
        pass


def wait_ready(
    control_q: Any, handles: Sequence[WorkerHandle], timeout_s: float, what: str
) -> dict[int, WorkerReady]:
    """Wait until every handle reports ready; raise with the reason if one fails or dies."""
    pending = {h.index for h in handles}
    ready: dict[int, WorkerReady] = {}
    deadline = time.monotonic() + timeout_s
    last_log = time.monotonic()
    while pending:
        msg = get_or_none(control_q, 0.2)
        if isinstance(msg, WorkerReady) and msg.index in pending:
            pending.discard(msg.index)
            ready[msg.index] = msg
            log.info("%s %d/%d ready (pid %d) %s", what, len(ready), len(handles), msg.pid,
                     msg.info or "")
        elif isinstance(msg, WorkerFailed):
            raise RuntimeError(f"{what} {msg.index} failed to start: {msg.message}")
        for h in handles:
            if h.index in pending and h.process is not None and not h.process.is_alive():
                raise RuntimeError(f"{what} {h.index} exited during start-up (code {h.process.exitcode})")
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{what}s {sorted(pending)} not ready after {timeout_s:.0f} s")
        if now - last_log > 5.0:
            log.info("waiting for %s(s) %s to start...", what, sorted(pending))
            last_log = now
    return ready


def start_up(control_q: Any, role: str, index: int, build: Callable[[], T]) -> T:
    """Run a worker's start-up; a failure goes to the parent (which fails start-up) and re-raises."""
    try:
        return build()
    except Exception as exc:
        report_failed(control_q, role, index, exc)
        raise


def report_ready(control_q: Any, role: str, index: int, **info: Any) -> None:
    try:  # after start-up nobody reads this queue: a restarted worker's report may not fit
        control_q.put(WorkerReady(role=role, index=index, pid=os.getpid(), info=info), timeout=1.0)
    except queue.Full:
        pass


def report_failed(control_q: Any, role: str, index: int, exc: BaseException) -> None:
    try:
        control_q.put(WorkerFailed(role=role, index=index, message=f"{type(exc).__name__}: {exc}"),
                      timeout=1.0)
    except Exception:  # noqa: BLE001 - the parent learns from the exit code instead
        pass
