"""The frozen start-up heap and the GC-pause timer (quiver_serve/engine/procs/heap.py)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from quiver_serve.engine.procs.heap import GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Leave the test process as it was: nothing stays frozen after a test."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _full_collection_s() -> float:
    best_s = float("inf")
    for _ in range(3):
        t0_s = time.perf_counter()
        gc.collect()
        best_s = min(best_s, time.perf_counter() - t0_s)
    return best_s


def test_freezing_the_startup_heap_makes_full_collections_short(unfrozen: None) -> None:
    """What a daemon process has after start-up (torch, the model, the app) is frozen: a full
    collection afterwards walks only newer objects, many times faster."""
    import torch  # noqa: F401 - the start-up heap of every daemon process holds it
    import torch_geometric  # noqa: F401

    before_s = _full_collection_s()
    frozen = freeze_startup_heap("test")
    after_s = _full_collection_s()
    assert frozen == gc.get_freeze_count() > 100_000, frozen  # torch + PyG alone are ~300 k
    assert after_s * 5 < before_s, (before_s, after_s)


def test_freeze_can_be_turned_off(unfrozen: None) -> None:
    assert freeze_startup_heap("test", enabled=False) == 0
    assert gc.get_freeze_count() == 0


def test_pauses_are_timed_by_generation_and_flushed_once() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
        got: list[tuple[int, float]] = []
        assert pauses.flush(lambda g, s: got.append((g, s))) >= 2
        generations = [g for g, _ in got]
        assert 2 in generations and 0 in generations, got
        assert all(0.0 <= s < 5.0 for _, s in got), got
    finally:
        pauses.close()
    gc.collect()
    assert pauses.flush(lambda g, s: pytest.fail("a closed timer recorded a pause")) == 0


def test_pending_pauses_are_bounded() -> None:
    from quiver_serve.engine.procs import heap

    pauses = GcPauses().install()
    try:
        for _ in range(heap.MAX_PENDING_PAUSES + 50):
            gc.collect(0)
    finally:
        pauses.close()
    assert pauses.flush(lambda g, s: None) == heap.MAX_PENDING_PAUSES


def test_collections_paused_defers_collections_to_the_end_of_the_window() -> None:
    """Load generators' windows: no automatic collection inside, one after, setting restored."""
    import gc

    from quiver_serve.engine.procs.heap import GcPauses, collections_paused

    pauses = GcPauses().install()
    try:
        with collections_paused():
            assert not gc.isenabled()
            for _ in range(50_000):  # cycles enough to trigger several generation-0 runs
                a: list = []
                a.append(a)
            inside: list = []
            pauses.flush(lambda g, s: inside.append(g))
        after: list = []
        pauses.flush(lambda g, s: after.append(g))
    finally:
        pauses.close()
    assert inside == [] and 2 in after  # the one full collection at the end
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # a caller that had them off keeps them off
    finally:
        gc.enable()
