"""The fault drill (``loadtest/faults.py``): every role of ``/v1/workers`` killed under load, no
request lost, every role back; a role the daemon does not have fails the drill by name."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest import faults
from loadtest.harness import Daemon


class StubDaemon:
    """``/v1/workers`` answers only; the main process is pid 1."""

    pid = 1

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict[str, Any]:
        assert path == "/v1/workers"
        return {"workers": self.rows}


def row(role: str, pid: int) -> dict[str, Any]:
    return {"role": role, "index": 0, "pid": pid, "alive": True, "ready": True}


def test_a_missing_role_fails_loudly_by_name() -> None:
    daemon = StubDaemon([row("frontend", 10), row("engine", 11)])
    with pytest.raises(SystemExit, match=r"\['sampler'\] not in /v1/workers.*'engine', 'frontend'"):
        faults.check_roles(daemon, ["engine", "sampler", "frontend"])  # type: ignore[arg-type]
    in_process = StubDaemon([row("frontend", 1), row("engine", 11), row("sampler", 12)])
    with pytest.raises(SystemExit, match="main process"):  # one front-end: a kill stops the daemon
        faults.check_roles(in_process, ["frontend"])  # type: ignore[arg-type]


@pytest.mark.e2e
@pytest.mark.slow
def test_drill_kills_every_role_under_load_and_loses_nothing(tmp_path) -> None:  # noqa: ANN001
    """~20 s of open-loop load at 20 req/s; engine, sampler and front-end killed in turn (the
    pure-torch CPU sampler: no C++ build inside the test's time)."""
    args = faults.parse_args(["--rate", "20", "--seconds", "20", "--restart-timeout-s", "30"])
    daemon = Daemon(args.config, log_path=tmp_path / "server.log",
                    overrides={"server.http_workers": 2}, env={"QUIVER_SERVE_DISABLE_CPP": "1"})
    with daemon:
        summary = faults.run_drill(daemon, args)
    assert summary["failures"] == [], (summary, daemon.log())
    assert summary["lost"] == 0 and summary["unsent"] == 0
    assert sum(summary["answered"].values()) == summary["sent"] > 300
    assert [k["role"] for k in summary["kills"]] == ["engine", "sampler", "frontend"]
    assert all(k["under_load"] and k["ready_after_s"] is not None for k in summary["kills"])
    restarted = " ".join(summary["worker_restarts_total"])
    assert all(f'role="{r}"}}' in restarted for r in faults.ROLES), restarted
