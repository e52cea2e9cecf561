"""Compiled bytecode kept in the cache folder when the interpreter keeps none beside the sources
(decision 0067, docs/architecture.md, "Start-up").

An image whose site-packages hold no ``.pyc`` (``pip install --no-compile``) and whose
interpreter may not write them (a read-only mount, or ``PYTHONDONTWRITEBYTECODE``, common in
container images) compiles torch and PyG from source in every process at every start: on the
H200 box 15.7 s for ``import torch_geometric``. :func:`keep_bytecode` points the daemon and its
children at ``$QUIVER_SERVE_CACHE/pycache`` (``PYTHONPYCACHEPREFIX``); where the interpreter
writes bytecode there itself nothing else is needed, and where writing is turned off each process
hands what it imported without bytecode to :func:`compile_later`: a low-priority child
(``python -m quiver_serve.engine.procs.bytecode LIST``) compiles it there, so the next start
reads it. This module imports nothing outside the standard library: the child starts in
milliseconds.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: set in the environment when the daemon's processes compile what they import (writing is off)
COMPILE_ENV = "QUIVER_SERVE_COMPILE_BYTECODE"
#: a compiling child stops after this long, or when its parent is gone
COMPILE_TIMEOUT_S = 900.0
#: the child's scheduling priority (nice): it runs beside a start-up and must not slow it
COMPILE_NICE = 10

_handed: set[str] = set()  # sources this process has handed to a compiling child
_children: list[subprocess.Popen] = []
_lock = threading.Lock()


def keep_bytecode(module: str = "torch", folder: Path | None = None) -> str | None:
    """Where the daemon's processes keep compiled bytecode when the interpreter keeps none beside
    ``module``'s sources (no ``.pyc`` there, and a folder it may not write, or writing turned
    off): sets ``PYTHONPYCACHEPREFIX`` (children inherit it) and this process's prefix to
    ``folder`` (default ``$QUIVER_SERVE_CACHE/pycache``), and :data:`COMPILE_ENV` when writing is
    off; returns the folder. None when nothing needs it (the bytecode is there or Python writes
    it there) or the operator set a prefix of their own."""
    if sys.pycache_prefix or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    spec = importlib.util.find_spec(module)  # finds, does not import
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.exists():
        return None
    writable = os.access(cached.parent if cached.parent.exists() else Path(spec.origin).parent,
                         os.W_OK)
    if writable and not sys.dont_write_bytecode:
        return None
    if folder is None:
        from quiver_serve import envs

        folder = envs.QUIVER_SERVE_CACHE / "pycache"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # code is read from it
    except OSError:
        return None
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(folder)
    if sys.dont_write_bytecode:
        os.environ[COMPILE_ENV] = "1"
    return str(folder)


def missing_sources() -> list[str]:
    """Sources of this process's imported modules with no bytecode in the prefix, not yet handed
    to a compiling child."""
    found = []
    for mod in list(sys.modules.values()):
        src = getattr(mod, "__file__", None)
        if not src or not src.endswith(".py") or not os.path.isabs(src) or src in _handed:
            continue
        try:
            if not os.path.exists(importlib.util.cache_from_source(src)):
                found.append(src)
        except (ValueError, NotImplementedError):
            continue
    return sorted(set(found))


def compile_later(role: str) -> threading.Thread | None:
    """Hand what this process imported without bytecode to a low-priority compiling child
    (only where :func:`keep_bytecode` turned it on), from a thread: the scan of the imported
    modules (a file check each) stays off the caller's start-up. The thread reaps the child and
    logs what it did; each source is handed once per process. Returns the thread, or None."""
    if not os.environ.get(COMPILE_ENV) or not sys.pycache_prefix:
        return None
    thread = threading.Thread(target=_compile, args=(role,), name="bytecode-compile",
                              daemon=True)
    thread.start()
    return thread


def _compile(role: str) -> None:
    child = hand_over(sys.pycache_prefix or "")
    if child is not None:
        _reap(*child, role)


def hand_over(prefix: str) -> tuple[subprocess.Popen, int, float] | None:
    """Start a compiling child for the imported sources without bytecode in ``prefix``:
    (the child, how many sources, when), or None when there are none."""
    with _lock:
        todo = missing_sources()
        if not todo:
            return None
        _handed.update(todo)
        fd, listing = tempfile.mkstemp(prefix="compile-", suffix=".txt", dir=prefix)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(todo))
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, listing, str(COMPILE_TIMEOUT_S)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _children.append(child)
    return child, len(todo), time.monotonic()


def _reap(child: subprocess.Popen, count: int, t0: float, role: str) -> None:
    try:
        _, err = child.communicate(timeout=COMPILE_TIMEOUT_S + 30.0)
    except subprocess.TimeoutExpired:
        child.kill()
        _, err = child.communicate()
    with _lock:
        if child in _children:
            _children.remove(child)
    failed = (err or b"").decode(errors="replace").strip()
    if child.returncode == 0:
        log.info("%s: compiled %d imported modules' bytecode into the cache in %.1f s (the next "
                 "start reads it)%s", role, count, time.monotonic() - t0,
                 f"; {failed}" if failed else "")
    else:
        log.warning("%s: compiling imported modules' bytecode ended with %s: %s", role,
                    child.returncode, failed[-300:])


@atexit.register
def stop_compilers() -> None:
    """Stop compiling children still running (the process is ending)."""
    with _lock:
        for child in _children:
            if child.poll() is None:
                child.kill()


def compile_listed(listing: Path, timeout_s: float) -> int:
    """The child: compile every source named in ``listing`` into the prefix (the interpreter's,
    from the environment); stops at ``timeout_s`` or when its parent is gone. Returns how many
    could not be compiled."""
    import py_compile

    if hasattr(os, "nice"):
        os.nice(COMPILE_NICE)
    parent, deadline = os.getppid(), time.monotonic() + timeout_s
    sources = listing.read_text().split("\n")
    listing.unlink(missing_ok=True)
    failed: list[str] = []
    for src in sources:
        if time.monotonic() > deadline or os.getppid() != parent:
            break
        try:
            if os.path.exists(importlib.util.cache_from_source(src)):
                continue  # another process's child compiled it
            py_compile.compile(src, doraise=True)  # written atomically: racing writers are safe
        except (py_compile.PyCompileError, OSError):
            failed.append(src)
    if failed:  # the parent logs it
        print(f"{len(failed)} could not be compiled, such as {failed[0]}", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    compile_listed(Path(sys.argv[1]), float(sys.argv[2]))
