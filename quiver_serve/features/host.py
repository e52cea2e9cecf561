"""Host-memory helpers of the feature store: NUMA-local first touch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def on_cpus(cpus: list[int] | None) -> Iterator[None]:
    """Run the block on ``cpus`` (None: unchanged). Linux places a page on the NUMA node of the
    CPU that first touches it, so rows written here live on those CPUs' node."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:  # CPUs outside this process's cgroup: leave placement to the kernel
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
