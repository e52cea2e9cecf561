"""Process plumbing shared by every process: spawn, liveness, bounded waits, stop."""

from __future__ import annotations

import multiprocessing as std_mp
import os
import queue
import time
from typing import Any

POLL_S = 0.05  # how often a blocked loop wakes to check for shutdown or a dead parent


def spawn_context() -> Any:
    """Processes that may touch CUDA must be spawned, never forked. (torch is imported here,
    not above: the daemon spawns its first processes before it imports torch, ``standby.prime``.)"""
    import torch.multiprocessing as mp  # registers the tensor reductions children use

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
