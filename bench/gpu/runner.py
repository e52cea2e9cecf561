"""Running a suite's steps: the wheels prologue, each step with its time limit, its log and what
the console shows, and the summary table last.

A step is a command (pytest, a bench module, ``nvidia-smi``) run from the repository root in its
own process group: past ``timeout_s`` the group gets SIGTERM, then SIGKILL ``kill_after_s`` later
(exit 124, as ``timeout -k``: a hung kernel blocks in C, where pytest-timeout cannot reach it).
Its whole output (progress bars split at ``\\r``) goes to ``<out>/<log>``; the console shows the
lines ``drop`` does not match, or only the last ``tail_lines`` of them.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.results import ROOT

WHEEL_DIR = ROOT / ".whl"
TIMEOUT_EXIT = 124


@dataclass
class Step:
    """One command of a suite."""

    name: str
    argv: list[str]  # the command; "{python}" is the interpreter, "{url}" a step daemon's URL
    timeout_s: float
    log: str  # file name in the output folder
    kill_after_s: float = 10.0
    drop: str | None = None  # regex of console lines left out (the log keeps them)
    tail_lines: int = 0  # >0: the console shows only the last lines
    result: Path | None = None  # the JSON the step writes
    counts: bool = True  # a failure fails the suite (False: information, e.g. nvidia-smi -L)
    required: bool = False  # a failure stops the suite (a missing dependency)
    background: bool = False  # started now, waited for after the next step
    on_fail: str | None = None  # printed when the step fails
    daemon: dict[str, Any] | None = None  # loadtest.harness.Daemon kwargs, started first


@dataclass
class Outcome:
    step: Step
    rc: int
    seconds: float
    note: str = ""


@dataclass
class Running:
    """A started step: its process, clock, daemon (if any), output reader and console tail."""

    step: Step
    proc: subprocess.Popen
    t0: float
    daemon: Any = None
    reader: threading.Thread | None = None
    lines: collections.deque = field(default_factory=collections.deque)


def install_wheels(python: str, skip: bool) -> str | None:
    """The wheels carried in ``.whl/`` (git-ignored: fastapi, uvicorn, pydantic, pyzmq,
    msgspec... that GPU boxes may lack) installed into a fresh folder outside the system
    packages; that folder, or None (no wheels, or ``skip``). Raises when they do not install."""
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    if skip or not wheels:
        return None
    site = tempfile.mkdtemp(prefix="qs-site.")
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", site, *map(str, wheels)]
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise RuntimeError(f"the wheels in {WHEEL_DIR} did not install (NO_WHEELS=1 or "
                           "--no-wheels skips them on a box with its own environment)")
    return site


def prologue_env(site: str | None, out_dir: Path) -> None:
    """This process's environment, inherited by every step: the wheels' folder and the
    repository first on PYTHONPATH, OUT the output folder."""
    path = [p for p in (site, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    os.environ["OUT"] = str(out_dir)


def start(step: Step, python: str, out_dir: Path) -> Running | Outcome:
    """Start ``step`` (its daemon first, if any); an Outcome when it could not start."""
    daemon, url = None, ""
    t0 = time.monotonic()
    if step.daemon is not None:
        from loadtest.harness import Daemon

        daemon = Daemon(**step.daemon, log_path=out_dir / f"{Path(step.log).stem}_server.log")
        try:
            daemon.wait_ready()
        except (RuntimeError, TimeoutError) as exc:
            daemon.stop()
            return Outcome(step, 1, time.monotonic() - t0, f"server: {str(exc).splitlines()[0]}")
        url = daemon.url
    argv = [a.replace("{python}", python).replace("{url}", url) for a in step.argv]
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        if daemon is not None:
            daemon.stop()
        return Outcome(step, 127, 0.0, str(exc))
    running = Running(step, proc, t0, daemon, lines=collections.deque(maxlen=step.tail_lines or None))
    running.reader = threading.Thread(target=copy_output, args=(running, out_dir / step.log),
                                      daemon=True)
    running.reader.start()
    return running


def copy_output(running: Running, log_path: Path) -> None:
    """Every line to the log; the console's lines printed (or kept for the tail)."""
    drop = re.compile(running.step.drop) if running.step.drop else None
    with open(log_path, "w", errors="replace") as log:
        for raw in iter(running.proc.stdout.readline, b""):  # type: ignore[union-attr]
            for line in raw.decode(errors="replace").replace("\r", "\n").splitlines():
                log.write(line + "\n")
                if drop is not None and drop.search(line):
                    continue
                if running.step.tail_lines:
                    running.lines.append(line)
                elif not running.step.background:
                    print(line, flush=True)


def finish(running: Running) -> Outcome:
    """Wait for the step within its time limit (then SIGTERM, SIGKILL the group)."""
    step, proc = running.step, running.proc
    left_s = step.timeout_s - (time.monotonic() - running.t0)
    note = ""
    try:
        rc = proc.wait(timeout=max(left_s, 0.1))
    except subprocess.TimeoutExpired:
        note = f"cut at {step.timeout_s:.0f} s"
        kill_group(proc, step.kill_after_s)
        rc = TIMEOUT_EXIT
    if running.reader is not None:
        running.reader.join(timeout=10)
    if running.daemon is not None:
        running.daemon.stop()
    for line in running.lines:
        print(line)
    return Outcome(step, rc, time.monotonic() - running.t0, note)


def kill_group(proc: subprocess.Popen, kill_after_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, kill_after_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_steps(steps: list[Step], python: str, out_dir: Path) -> list[Outcome]:
    """Each step in order; a background step is waited for after the next one."""
    outcomes: list[Outcome] = []
    pending: list[Running] = []
    for step in steps:
        if not step.background:
            print(f"\n== {step.name} ==", flush=True)
        started = start(step, python, out_dir)
        if isinstance(started, Running) and step.background:
            pending.append(started)
            continue
        outcome = started if isinstance(started, Outcome) else finish(started)
        outcomes.append(outcome)
        outcomes += [report_background(finish(r)) for r in pending]
        pending = []
        if outcome.rc != 0 and step.on_fail:
            print(step.on_fail, flush=True)
        if outcome.rc != 0 and step.required:
            break
    outcomes += [report_background(finish(r)) for r in pending]
    return outcomes


def report_background(outcome: Outcome) -> Outcome:
    print(f"({outcome.step.name}: exit {outcome.rc})", flush=True)
    return outcome


def summary(suite: str, outcomes: list[Outcome], out_dir: Path) -> int:
    """The table of steps, last; 1 when a counted step failed."""
    print("\n| step | exit | seconds | log | result |\n|---|---|---|---|---|")
    for o in outcomes:
        res = o.step.result
        shown = "-" if res is None else (res.name if res.exists() else f"{res.name} (missing)")
        mark = "" if o.step.counts else " (info)"
        note = f" {o.note}" if o.note else ""
        print(f"| {o.step.name}{mark} | {o.rc}{note} | {o.seconds:.0f} | {o.step.log} | {shown} |")
    failed = [o.step.name for o in outcomes if o.rc != 0 and o.step.counts]
    verdict = f"failed: {', '.join(failed)}" if failed else "every step passed"
    print(f"\n== {suite}: {verdict} (logs and JSON in {out_dir}) ==", flush=True)
    return 1 if failed else 0


def python_default() -> str:
    return os.environ.get("PYTHON") or sys.executable
