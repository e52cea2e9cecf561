"""The interpreter's switch interval in the daemon's processes (decision 0058).

A thread back from a wait (a socket, a CUDA stream, an fsync) needs the interpreter lock again;
while another thread runs Python, CPython hands it over only after the switch interval (5 ms by
default). An engine core's loop waits like that on every batch while its refresh and update
planner threads run Python; ``inference.switch_interval_ms`` sets it in every daemon process (CPython's
5 ms by default: 0.5 ms lost capacity on the H200).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from quiver_serve.config import ServeConfig
from tests.conftest import ServerProcess


def reentry_ms(steps: int = 1500) -> np.ndarray:
    """How late a thread gets going again after 0.5 ms waits, while a second thread runs Python."""
    stop = threading.Event()

    def python_work() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    other = threading.Thread(target=python_work, daemon=True)
    other.start()
    late = []
    try:
        for _ in range(steps):
            due = time.perf_counter() + 0.0005
            time.sleep(0.0005)
            late.append(time.perf_counter() - due)
    finally:
        stop.set()
        other.join(5)
    return np.asarray(late) * 1e3


def test_a_short_configured_interval_bounds_the_wait_for_the_interpreter() -> None:
    cfg = ServeConfig.model_validate({"inference": {"switch_interval_ms": 0.5}})
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(cfg.inference.switch_interval_ms / 1e3)
        ours = float(np.median(reentry_ms()))
        sys.setswitchinterval(0.005)  # CPython's default
        default = float(np.median(reentry_ms()))
    finally:
        sys.setswitchinterval(before)
    assert ours < 2.0 and default > 2.5 * ours, (ours, default)


@pytest.mark.e2e
def test_engine_cores_run_with_the_configured_interval(server: ServerProcess) -> None:
    want = ServeConfig().inference.switch_interval_ms
    assert f"interpreter switch interval {want:.3g} ms" in server.log(200_000)
