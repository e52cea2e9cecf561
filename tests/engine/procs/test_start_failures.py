"""A child that keeps dying before it becomes ready: back-off, then the daemon gives up.

The unit tests drive the one watch loop (``supervisor.ChildSet``) with fake processes and a
made-up clock; the e2e test starts the real daemon with a front-end whose FastAPI import fails
and checks that it exits 1 with one line naming the front-end and the error, instead of
restarting it forever.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from quiver_serve.engine.procs import supervisor as sup
from quiver_serve.engine.procs.process import stop_process_group
from quiver_serve.engine.procs.supervisor import Child, ChildSet, exit_reason, start_backoff_s
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[3]


class FakeProcess:
    """What ChildSet reads of a process: pid, is_alive, exitcode, kill, join."""

    pids = iter(range(1000, 10**6))

    def __init__(self, exitcode: int | None = 1) -> None:
        self.pid = next(FakeProcess.pids)
        self.exitcode = exitcode  # None: alive

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        return None


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[FakeProcess]:
    """``Child.start`` installs a fake process (dead at once unless told otherwise)."""
    made: list[FakeProcess] = []

    def fake_start(self: Child, standby: Any = None) -> None:
        made.append(FakeProcess(exitcode=getattr(self, "next_exit", 1)))
        self.process = made[-1]
        self.started_s = self.last_beat_s = 0.0
        self.ready, self.error, self.restart_at_s = False, None, None

    monkeypatch.setattr(Child, "start", fake_start)
    return made


def one_child(limit: int = 5, **kw: Any) -> tuple[Child, ChildSet, list[str]]:
    child = Child("frontend", 1, print, ())
    fatal: list[str] = []
    kids = ChildSet([child], None, None, limit, **kw)
    kids.on_fatal = fatal.append
    return child, kids, fatal


def test_back_off_doubles_up_to_a_cap() -> None:
    assert [start_backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert exit_reason(1) == "exit code 1" and exit_reason(-9) == "killed by SIGKILL"


def test_a_child_that_never_becomes_ready_is_retried_with_back_off_then_given_up(
        spawned: list[FakeProcess]) -> None:
    child, kids, fatal = one_child(limit=5)
    child.start()
    now_s, restarts_at = 0.0, []
    while not fatal and now_s < 120:
        kids.check(child, now_s)
        if len(spawned) > len(restarts_at) + 1:
            restarts_at.append(now_s)
        now_s = round(now_s + 0.5, 1)
    # each death is seen on the turn after its restart (0.5 s later), then waits 1, 2, 4, 8 s
    assert restarts_at == [1.0, 3.5, 8.0, 16.5]
    assert len(spawned) == 5 and child.restarts == 4
    assert fatal == ["quiver-serve: frontend 1 failed 5 times before it became ready: "
                     "exit code 1"]
    assert kids.fatal == fatal[0]
    kids.check(child, 1000.0)
    assert len(spawned) == 5, "nothing restarts once the supervisor gave up"


def test_the_line_names_the_childs_reported_error_on_one_line(spawned: list[FakeProcess]) -> None:
    child, kids, fatal = one_child(limit=1)
    child.start()
    child.error = "ConfigError: bad config\n  server.port: too big"  # its "failed" message
    kids.check(child, 0.0)
    assert fatal == ["quiver-serve: frontend 1 failed 1 times before it became ready: "
                     "ConfigError: bad config server.port: too big"]


def test_a_child_that_was_ready_is_restarted_at_once_and_its_count_starts_over(
        spawned: list[FakeProcess]) -> None:
    child, kids, fatal = one_child(limit=2)
    child.start()
    kids.check(child, 0.0)  # first death before ready: 1 of 2
    assert child.failures == 1 and child.restart_at_s == 1.0
    child.next_exit = None  # type: ignore[attr-defined]  # the next run lives and serves
    kids.check(child, 1.0)
    child.ready, child.failures = True, 0  # what its "ready" message does (read_control)
    spawned[-1].kill()  # kill -9 while serving
    kids.check(child, 50.0)
    assert len(spawned) == 3 and child.restarts == 2 and child.failures == 0, \
        "a ready child that dies is restarted in the same turn, and is no start failure"
    assert not fatal


def test_a_refused_spawn_counts_as_a_start_failure(spawned: list[FakeProcess],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    child, kids, fatal = one_child(limit=2)
    child.start()
    child.ready = True  # it served, then died; the OS refuses every restart
    monkeypatch.setattr(Child, "start", lambda self, standby=None: (_ for _ in ()).throw(
        OSError(24, "Too many open files")))
    for now_s in (10.0, 11.0, 12.0, 13.0):
        kids.check(child, now_s)
    assert fatal == ["quiver-serve: frontend 1 failed 2 times before it became ready: "
                     "OSError: [Errno 24] Too many open files"]


def test_nothing_restarts_or_counts_while_draining(spawned: list[FakeProcess]) -> None:
    deaths: list[int] = []
    child, kids, fatal = one_child(limit=1, may_restart=lambda: False,
                                   on_death=lambda c: deaths.append(c.pid))
    child.start()
    for now_s in (0.0, 5.0, 60.0):
        kids.check(child, now_s)
    assert len(spawned) == 1 and deaths == [spawned[0].pid] and not fatal


def test_step_never_restarts_after_the_limit_and_standby_waits(
        spawned: list[FakeProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "START_BACKOFF_FIRST_S", 0.0)
    ticks: list[bool] = []

    class Standby:
        def tick(self, all_ready: bool) -> None:
            ticks.append(all_ready)

    child = Child("engine", 0, print, ())
    kids = ChildSet([child], None, Standby(), 3)  # type: ignore[arg-type]
    child.start()
    for _ in range(10):
        kids.step(0)
    assert len(spawned) == 3 and kids.fatal is not None and kids.fatal.startswith(
        "quiver-serve: engine 0 failed 3 times")
    assert not any(ticks), "no standby is spawned while a child is not ready"


# ---- the real daemon ------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_daemon_exits_with_one_line_when_a_frontend_cannot_import_fastapi(tmp_path: Path) -> None:
    """Every front-end fails at ``import fastapi``: the daemon used to restart them forever
    (~37 restarts in 70 s); now it exits 1 within 60 s, its last line naming the front-end and
    the error."""
    broken = tmp_path / "site" / "fastapi"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(broken.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.Popen(
        [sys.executable, "server.py", "--http-workers", "2", "--port", str(free_port())],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop_process_group(proc, grace_s=5.0)
        pytest.fail("the daemon kept restarting a front-end that cannot start for 60 s")
    finally:
        if proc.poll() is None:
            stop_process_group(proc, grace_s=5.0)
    elapsed_s = time.monotonic() - t0
    last = err.strip().splitlines()[-1]
    print(f"exit {proc.returncode} after {elapsed_s:.1f} s: {last}")
    assert proc.returncode == 1, err[-3000:]
    assert re.fullmatch(r"quiver-serve: frontend [01] failed 5 times before it became ready: "
                        r"(ModuleNotFoundError|ImportError): No module named 'fastapi'", last), last
    restarts = len(re.findall(r"frontend \d \(pid \d+\) died before it became ready", err))
    assert restarts <= 2 * 4, f"{restarts} restarts: more than the back-off allows"
