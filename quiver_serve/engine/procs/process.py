"""Process plumbing shared by every process: spawn, liveness, bounded waits, stop."""

from __future__ import annotations

import multiprocessing as std_mp
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.05  # how often a blocked loop wakes to check for shutdown or a dead parent


def keep_bytecode(module: str = "torch", folder: Path | None = None) -> str | None:
    """Where the daemon's children keep compiled bytecode when the interpreter cannot keep it
    beside ``module``'s sources (no ``.pyc`` there, and a folder it may not write): a spawned
    child would otherwise compile torch and PyG from source at every start. Sets
    ``PYTHONPYCACHEPREFIX`` (children inherit it) to ``folder`` (default
    ``$QUIVER_SERVE_CACHE/pycache``) and returns it; None when nothing needs it (the bytecode is
    there or can be written, a prefix is already set, or writing bytecode is turned off)."""
    import importlib.util

    if sys.pycache_prefix or os.environ.get("PYTHONPYCACHEPREFIX") or sys.dont_write_bytecode:
        return None
    spec = importlib.util.find_spec(module)  # finds, does not import
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.exists() or os.access(cached.parent if cached.parent.exists()
                                    else Path(spec.origin).parent, os.W_OK):
        return None
    if folder is None:
        from quiver_serve import envs

        folder = envs.QUIVER_SERVE_CACHE / "pycache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    return str(folder)


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
