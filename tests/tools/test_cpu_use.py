"""The change bench's CPU meter (``loadtest/cpu_use.py``): cores used per role in a window."""

from __future__ import annotations

import os
import time

from loadtest.cpu_use import CpuMeter, machine_busy_s, process_cpu_s


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_process_counts_about_one_core_and_the_machine_at_least_that() -> None:
    meter = CpuMeter("http://127.0.0.1:9", {}, os.getpid())  # no daemon there: this process only
    meter.mark()
    burn(0.5)
    cores = meter.cores()
    assert cores is not None
    assert 0.6 <= cores["main"] <= 1.2, cores  # one thread spinning
    assert cores["machine"] >= 0.5 * cores["main"] and cores["other"] >= 0.0
    assert cores["cpus"] == float(os.cpu_count())


def test_a_gone_process_reads_as_none() -> None:
    assert process_cpu_s(2**22 + 12345) is None
    assert process_cpu_s(os.getpid()) is not None and machine_busy_s() is not None
