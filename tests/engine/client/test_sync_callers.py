"""Callers that block on their answers (``Pipeline.embed`` from threads): the waiter they block
on, the chain that wakes them in turn, and the gate that sends their next requests together
(the same in a real pipeline: ``test_pipeline.py``). No processes here."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

from quiver_serve.engine.client.client import EngineClient
from quiver_serve.engine.client.inflight import Waiter, wake_in_turn
from quiver_serve.engine.client.returns import ReturnGate
from quiver_serve.messages import EmbedResult

WAIT_S = 5.0


def _blocked(waiters: list[Waiter], got: dict[int, EmbedResult | None]) -> list[threading.Thread]:
    """One thread per waiter, each blocked on it; ``got[i]``: what waiter ``i`` returned."""
    def wait(i: int) -> None:
        got[i] = waiters[i].wait(WAIT_S)

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(waiters))]
    for t in threads:
        t.start()
    return threads


def test_waiter_answers_its_one_caller_and_times_out_without_an_answer() -> None:
    w = Waiter()
    t0 = time.monotonic()
    assert w.wait(0.05) is None and time.monotonic() - t0 >= 0.04
    got: dict[int, EmbedResult | None] = {}
    (thread,) = _blocked([w], got)
    w.set_result(EmbedResult("a"))
    thread.join(WAIT_S)
    assert got[0] is not None and got[0].request_id == "a"
    assert w.wait(0.0) is got[0]  # a second wait returns at once
    w.wake()  # a stray wake (the IO thread's check of a chain) harms nothing
    assert w.done() and w.woken


def test_waiters_woken_in_turn_each_get_their_own_answer() -> None:
    waiters = [Waiter() for _ in range(64)]
    got: dict[int, EmbedResult | None] = {}
    threads = _blocked(waiters, got)
    wake_in_turn(waiters, [EmbedResult(f"r{i}") for i in range(64)])
    for t in threads:
        t.join(WAIT_S)
    assert {i: r.request_id for i, r in got.items() if r} == {i: f"r{i}" for i in range(64)}


def test_a_chain_whose_caller_left_is_woken_by_the_io_threads_check() -> None:
    """A caller that left its wait (an exception) wakes nobody: the rest of its chain sleeps
    until the IO thread's check, which wakes every waiter still asleep."""
    waiters = [Waiter() for _ in range(4)]
    got: dict[int, EmbedResult | None] = {}
    threads = _blocked(waiters[:1] + waiters[2:], got)
    wake_in_turn(waiters, [EmbedResult(f"r{i}") for i in range(4)])  # waiters[1] has no caller
    threads[0].join(WAIT_S)
    time.sleep(0.05)
    assert not waiters[2].woken and not waiters[3].woken
    fake = SimpleNamespace(_chains=deque([(time.monotonic() - 1.0, waiters)]))
    EngineClient._check_chains(fake, time.monotonic())  # type: ignore[arg-type]
    for t in threads:
        t.join(WAIT_S)
    assert sorted(r.request_id for r in got.values() if r) == ["r0", "r2", "r3"]
    assert not fake._chains


def test_gate_never_holds_a_single_caller() -> None:
    gate = ReturnGate()
    gate.answered(1, 10.0)
    assert gate.wake_now(1) and gate.release(1, 10.0)
    assert gate.hits == 1 and gate.expected == 0


def test_gate_holds_answered_callers_until_all_are_back() -> None:
    gate = ReturnGate(quiet_s=0.001, max_hold_s=0.01)
    gate.answered(40, 10.0)
    gate.answered(24, 10.0002)  # a second reply of the same round
    assert not gate.wake_now(63) and gate.wake_now(64)
    assert gate.wait_s(10.0002) == pytest.approx(0.001)
    assert not gate.release(30, 10.0005)
    assert gate.release(64, 10.0009)
    assert (gate.holds, gate.hits, gate.expected) == (1, 1, 0)
    assert gate.wait_s(10.001) is None and gate.release(1, 10.001)  # no hold: leaves at once


def test_gate_lets_the_waiting_go_when_callers_stop_coming_back() -> None:
    gate = ReturnGate(quiet_s=0.001, max_hold_s=0.005)
    gate.answered(64, 10.0)
    assert not gate.release(10, 10.0008)  # 10 came back: keep looking
    assert not gate.release(20, 10.0016)  # 10 more since the last look
    assert gate.release(20, 10.0027)  # none since: the 20 leave, a miss
    assert gate.hits == 0 and gate.hit_rate < 1.0 and gate.expected == 0
    gate.answered(64, 20.0)
    for k in range(1, 6):  # still coming back, but no longer than max_hold_s
        assert not gate.release(10 * k, 20.0 + 0.0009 * k)
    assert gate.release(60, 20.0051)
    gate.answered(64, 30.0)
    assert not gate.release(0, 30.0005)
    assert not gate.release(0, 30.0011) and gate.expected == 0  # nobody came back: a miss


def test_gate_stops_holding_when_holds_do_not_pay_and_probes_again() -> None:
    gate = ReturnGate(quiet_s=0.001)
    now = 0.0
    while gate.hit_rate >= gate.min_hit_rate:  # open-loop callers: nobody comes back soon
        gate.answered(8, now)
        assert gate.release(0, now + 0.002) is False  # the hold ends empty: a miss
        now += 1.0
    gate.answered(8, now)
    assert gate.expected == 0 and gate.wake_now(1)  # not held
    for _ in range(10):
        gate.release(1, now)
    gate.answered(8, now)
    assert gate.expected == 8  # tried again
