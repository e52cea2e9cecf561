"""Warm standby processes (``engine/procs/standby.py``): a restart takes a process that has already
imported torch and PyG instead of spawning a fresh interpreter."""

from __future__ import annotations

import os
import time
from pathlib import Path

from quiver_serve.engine.procs.standby import StandbyPool, prime


def write_pid(path: str, tag: str) -> None:
    """A child's target: leaves its pid and tag behind."""
    Path(path).write_text(f"{os.getpid()} {tag}")


def wait_for(cond, timeout_s: float = 60.0) -> bool:  # noqa: ANN001 - a zero-argument callable
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_standby_runs_the_target_it_is_handed_and_is_replaced(tmp_path: Path) -> None:
    pool = StandbyPool(("json",), size=1, name="test-standby")
    try:
        pool.refill()
        assert wait_for(lambda: pool.warm() == 1), "the standby never finished its imports"
        (standby_pid,) = pool.pids()
        out = tmp_path / "out"
        proc = pool.take(write_pid, (str(out), "engine-0"), "quiver-engine-0")
        assert proc is not None and proc.pid == standby_pid
        assert wait_for(out.exists)
        assert out.read_text() == f"{standby_pid} engine-0"  # ran in the standby itself
        proc.join(timeout=10)
        assert proc.exitcode == 0 and pool.promoted == 1
        assert pool.take(write_pid, (str(out), "x"), "x") is None  # none left until refilled
        assert wait_for(lambda: (pool.refill(), len(pool.pids()) == 1)[1], timeout_s=10)
        assert pool.pids()[0] != standby_pid
    finally:
        pool.stop()
    assert pool.pids() == []


def test_a_standby_taken_before_it_is_warm_runs_its_target(tmp_path: Path) -> None:
    """Taken while it still imports (a worker killed soon after start-up): the supervisor sends
    the hand-over and closes its end before the standby says it is warm; the standby must run
    the target, not exit on the closed pipe (it did, and the restart fell back to a fresh
    spawn: 6-7 s instead of under 5 on the 2-core box)."""
    pool = StandbyPool(("torch",), size=1, name="test-standby-cold")
    try:
        pool.refill()
        (standby_pid,) = pool.pids()
        assert pool.warm() == 0  # torch takes seconds to import
        out = tmp_path / "out"
        proc = pool.take(write_pid, (str(out), "frontend-0"), "quiver-frontend-0")
        assert proc is not None and proc.pid == standby_pid
        assert wait_for(out.exists), "the cold standby never ran its target"
        assert out.read_text() == f"{standby_pid} frontend-0"
        proc.join(timeout=10)
        assert proc.exitcode == 0
    finally:
        pool.stop()


def test_a_dead_standby_is_skipped_and_stop_ends_the_waiting_ones(tmp_path: Path) -> None:
    pool = StandbyPool((), size=2, name="test-standby")
    try:
        assert wait_for(lambda: (pool.refill(), len(pool.pids()) == 2)[1], timeout_s=10)
        first, second = pool.pids()
        os.kill(first, 9)
        assert wait_for(lambda: first not in pool.pids())
        proc = pool.take(write_pid, (str(tmp_path / "out"), "sampler-1"), "quiver-sampler-1")
        assert proc is not None and proc.pid == second  # the live one, not the killed one
        proc.join(timeout=10)
        assert wait_for(lambda: (pool.refill(), len(pool.pids()) == 2)[1], timeout_s=10)
        waiting = pool.pids()
    finally:
        pool.stop()
    assert pool.pids() == []
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in waiting)


def test_no_standby_when_disabled() -> None:
    pool = StandbyPool(("json",), size=0, name="test-standby")
    pool.refill()
    assert pool.pids() == [] and pool.take(write_pid, ("/nonexistent", "x"), "x") is None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_standbys_wait_until_every_child_has_been_ready_a_while(monkeypatch) -> None:  # noqa: ANN001
    """``tick``: nothing while a child is not ready (start-up, a restart), then a refill once all
    have been ready for SETTLE_S; a child going unready starts the wait again."""
    from quiver_serve.engine.procs import standby as standby_mod

    monkeypatch.setattr(standby_mod, "SETTLE_S", 0.3)
    pool = StandbyPool((), size=1, name="test-standby")
    try:
        pool.tick(False)
        pool.tick(True)  # settled clock starts now
        assert pool.pids() == []
        pool.tick(False)  # a child restarting: the clock starts over
        pool.tick(True)
        time.sleep(0.2)
        pool.tick(True)
        assert pool.pids() == []
        time.sleep(0.2)
        pool.tick(True)
        assert len(pool.pids()) == 1
    finally:
        pool.stop()


def write_env(path: str, name: str) -> None:
    """A child's target: leaves its pid and one environment variable behind."""
    Path(path).write_text(f"{os.getpid()} {os.environ.get(name)}")


def test_primed_standbys_are_adopted_by_the_first_pool_and_trimmed_to_its_size(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001 - pytest's monkeypatch
    """``server.spawn_early``: standbys spawned before the supervisor exists are the ones its
    first child takes; the environment of the hand-over, not of the standby's spawn, is the
    child's (a variable set in between reaches it); what the start did not take is stopped
    down to the pool's size."""
    prime(("json",), 2, "test-primed")
    monkeypatch.setenv("QS_TEST_PRIMED", "after-the-spawn")
    pool = StandbyPool(("json",), size=0, name="test-standby")
    try:
        primed = pool.pids()
        assert len(primed) == 2  # adopted: no spawn of its own
        assert StandbyPool(("json",), size=0, name="other").pids() == []  # adopted once
        out = tmp_path / "out"
        proc = pool.take(write_env, (str(out), "QS_TEST_PRIMED"), "quiver-engine-0")
        assert proc is not None and proc.pid == primed[0]
        assert wait_for(out.exists)
        assert out.read_text() == f"{primed[0]} after-the-spawn"
        proc.join(timeout=10)
        pool.trim()  # size 0: the other primed standby is stopped
        assert pool.pids() == []
    finally:
        pool.stop()


def test_a_start_waits_for_the_primed_standbys_imports_within_a_bound(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001 - pytest's monkeypatch
    """CPU samplers of a start are spawned once the engine cores' primed
    standbys have imported (``wait_primed``; decision 0067), never later than the bound, and at
    once when nothing was primed or the standby died."""
    from quiver_serve.engine.procs import standby

    monkeypatch.setattr(standby, "_primed_procs", [])
    assert standby.wait_primed(30.0) < 0.1  # nothing primed
    (tmp_path / "qs_slow_import.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned standby inherits sys.path
    prime(("qs_slow_import",), 1, "test-gate")
    pool = StandbyPool(("qs_slow_import",), size=0, name="test-gate")
    try:
        assert standby.wait_primed(0.3) < 1.0  # bounded: the imports are not done yet
        waited_s = standby.wait_primed(60.0)
        assert 0.5 < waited_s < 60.0  # waited for the import itself
        assert wait_for(lambda: pool.warm() == 1, 10.0)  # and the pool sees it warm
        assert standby.wait_primed(60.0) < 0.1  # done once
        pool.stop()
        monkeypatch.setattr(standby, "_primed_procs", [])
        prime(("qs_slow_import",), 1, "test-gate")
        dead = StandbyPool(("qs_slow_import",), size=0, name="test-gate")
        for proc in list(standby._primed_procs):
            proc.kill()
        assert standby.wait_primed(60.0) < 5.0  # a dead standby does not hold the start
        dead.stop()
    finally:
        pool.stop()
