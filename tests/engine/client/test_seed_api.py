"""The seed's stage API (docs/architecture.md, "Outside contracts") end to end on Cora, over the one
engine the Pipeline runs; and the QueueBridge under it (and under ``Pipeline.request_queue()``)
without processes."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from quiver_serve import (
    EmbedRequest,
    EmbedResult,
    HybridSampler,
    InferenceServer,
    Pipeline,
    RequestBatcher,
    errors,
)
from quiver_serve.engine.client.queue_bridge import QueueBridge
from quiver_serve.graph.csc import GraphData
from tests.conftest import small_config

CAPACITY = 16  # the seed stack's bound: small, so backpressure shows within a test
DIM = 64
STOP_BOUND_S = 10.0


@dataclass
class Stack:
    """The seed's example, as written there; ``send`` counts items (a LongTensor's id)."""

    stream: Any
    batcher: RequestBatcher
    sampler: HybridSampler
    server: InferenceServer
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def results(self) -> Any:
        (q,) = self.server.result_queue_list()
        return q

    def send(self, item: Any) -> str:
        """Put one item; its arrival number (a LongTensor's request id)."""
        with self.lock:
            seq, self.sent = self.sent, self.sent + 1
        self.stream.put(item, timeout=30)
        return str(seq)

    def take(self, n: int, timeout_s: float = 30.0) -> list[EmbedResult]:
        return [self.results.get(timeout=timeout_s) for _ in range(n)]


def seed_stack(cora: GraphData, **overrides: object) -> Stack:
    cfg = small_config(model__weights=None, batching__max_delay_ms=1.0, **overrides)
    stream = mp.get_context("spawn").Queue(maxsize=8)
    batcher = RequestBatcher(cfg, stream)
    sampler = HybridSampler(cfg, cora, batcher.batched_request_queue_list())
    server = InferenceServer(cfg, cora, sampler.sampled_request_queue_list())
    return Stack(stream, batcher, sampler, server)


@pytest.fixture(scope="module")
def stack(cora: GraphData) -> Iterator[Stack]:
    s = seed_stack(cora, batching__queue_capacity=CAPACITY)
    try:
        s.sampler.start()
        s.server.start()
        yield s
    finally:
        s.batcher.stop()
        s.sampler.stop()
        s.server.stop()


@pytest.fixture(scope="module")
def pipeline(cora: GraphData) -> Iterator[Pipeline]:
    p = Pipeline(small_config(model__weights=None, batching__max_delay_ms=1.0), graph=cora).start()
    yield p
    p.stop()


def request(rid: str, ids: list[int], **kw: Any) -> EmbedRequest:
    return EmbedRequest(request_id=rid, node_ids=torch.tensor(ids), **kw)


@pytest.mark.e2e
def test_every_request_is_answered_once_in_arrival_order(stack: Stack) -> None:
    sizes = [1 + (7 * i) % 13 for i in range(120)]
    feeder = threading.Thread(target=lambda: [
        stack.send(request(f"o{i}", [(i + j) % 2708 for j in range(k)]))
        for i, k in enumerate(sizes)])
    feeder.start()
    got = stack.take(len(sizes))
    feeder.join(timeout=30)
    assert [r.request_id for r in got] == [f"o{i}" for i in range(len(sizes))]
    assert all(r.ok and r.embeddings.shape == (k, DIM) for r, k in zip(got, sizes, strict=True))
    with pytest.raises(queue.Empty):  # nothing more arrives
        stack.results.get(timeout=0.5)


@pytest.mark.e2e
def test_long_tensors_get_their_arrival_number_as_id(stack: Stack) -> None:
    first = stack.send(torch.tensor([1, 2, 3]))
    stack.send(request("named", [4]))
    second = stack.send(torch.tensor([5], dtype=torch.int32))
    got = stack.take(3)
    assert [r.request_id for r in got] == [first, "named", second]
    assert [tuple(r.embeddings.shape) for r in got] == [(3, DIM), (1, DIM), (1, DIM)]


@pytest.mark.e2e
def test_seeded_and_exact_results_equal_the_pipelines(stack: Stack, pipeline: Pipeline) -> None:
    ids = [0, 1, 2707, 1, 1500]
    stack.send(request("seeded", ids, seed=123))
    stack.send(request("exact", ids, exact=True))
    seeded, exact = stack.take(2)
    torch.testing.assert_close(seeded.embeddings, pipeline.embed(ids, seed=123), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exact.embeddings, pipeline.embed(ids, exact=True), atol=1e-4, rtol=1e-4)


@pytest.mark.e2e
def test_bad_requests_are_answered_with_named_errors_in_order(stack: Stack) -> None:
    stack.send(request("high", [5, 2708]))
    stack.send(request("low", [-5]))
    stack.send("not a request")  # logged and skipped: no result
    stack.send(request("seed", [1], seed=-1))
    stack.send(request("many", list(range(5000))))
    stack.send(request("late", [1], deadline_s=time.time() - 1.0))
    stack.send(request("good", [7]))
    got = {r.request_id: r for r in stack.take(6)}
    assert list(got) == ["high", "low", "seed", "many", "late", "good"]
    assert (got["high"].error.status, got["high"].error.code) == (400, "invalid_node_ids")
    assert got["high"].error.message == "node id 2708 is out of range: valid ids are 0..2707"
    assert got["low"].error.message == "node id -5 is out of range: valid ids are 0..2707"
    assert (got["seed"].error.status, got["seed"].error.code) == (400, "invalid_seed")
    assert got["many"].error.status == 413
    assert (got["late"].error.code, got["late"].error.message, got["late"].error.status) == \
        errors.DEADLINE
    assert got["good"].ok and got["good"].embeddings.shape == (1, DIM)


@pytest.mark.e2e
def test_a_caller_not_reading_results_holds_back_its_stream(stack: Stack) -> None:
    n = 3 * CAPACITY
    feeder = threading.Thread(target=lambda: [stack.send(request(f"b{i}", [i])) for i in range(n)],
                              daemon=True)
    feeder.start()
    time.sleep(2.0)  # nobody reads: at most CAPACITY are taken, the stream (8) fills, puts wait
    assert stack.results.qsize() <= CAPACITY
    assert feeder.is_alive()
    got = stack.take(n)
    feeder.join(timeout=30)
    assert [r.request_id for r in got] == [f"b{i}" for i in range(n)] and all(r.ok for r in got)


@pytest.mark.e2e
def test_stop_in_any_order_joins_in_time_and_answers_what_it_took(cora: GraphData) -> None:
    before = set(threading.enumerate())
    s = seed_stack(cora)
    s.server.stop()  # before start: nothing to do
    s = seed_stack(cora)
    with pytest.raises(RuntimeError, match=r"HybridSampler.start\(\) first"):
        s.server.start()
    s.sampler.start()
    s.server.start()
    s.send(request("before", [3]))
    assert s.take(1)[0].ok
    assert s.sampler.supervisor is not None
    children = s.sampler.supervisor.children
    t0 = time.monotonic()
    s.sampler.stop()  # the engine goes first, its client still connected
    s.send(request("orphan", [4]))
    end = time.monotonic() + 10
    while s.stream.qsize() and time.monotonic() < end:
        time.sleep(0.01)  # taken by the bridge, in flight at a client with no engine
    s.server.stop()
    s.batcher.stop()
    s.server.stop()  # twice: a no-op
    assert time.monotonic() - t0 < STOP_BOUND_S
    orphan = s.take(1, timeout_s=5)[0]
    assert orphan.request_id == "orphan" and orphan.error.status in (503, 504)
    assert not any(c.alive() for c in children)
    assert not [t.name for t in set(threading.enumerate()) - before
                if t.name.startswith("quiver-seed-api")]


# ---- the bridge alone (no processes) ---------------------------------------------------------
class HeldSubmit:
    """A submit whose futures the test resolves, in any order."""

    def __init__(self) -> None:
        self.futures: dict[str, Future[EmbedResult]] = {}

    def __call__(self, req: EmbedRequest) -> Future[EmbedResult]:
        if req.request_id == "refused":
            raise errors.invalid("refused here")
        fut: Future[EmbedResult] = Future()
        self.futures[req.request_id] = fut
        return fut

    def resolve(self, rid: str) -> None:
        self.futures[rid].set_result(EmbedResult(rid, embeddings=torch.zeros(1, 2)))


def wait_for(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.005)


def test_bridge_keeps_arrival_order_and_its_bound() -> None:
    requests: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue(maxsize=4)
    submit = HeldSubmit()
    bridge = QueueBridge(requests, results, submit, capacity=4, ordered=True)
    bridge.start()
    try:
        for rid in ("a", "refused", "b", "c", "d", "e"):
            requests.put(EmbedRequest(rid, torch.tensor([1])))
        wait_for(lambda: len(submit.futures) == 3)
        time.sleep(0.1)
        assert bridge.in_flight == 4 and requests.qsize() == 2  # "d", "e" wait: the bound
        submit.resolve("c")
        submit.resolve("b")
        time.sleep(0.05)
        assert results.qsize() == 0  # "a" is first and not answered yet
        submit.resolve("a")
        got = [results.get(timeout=1).request_id for _ in range(4)]
        assert got == ["a", "refused", "b", "c"]
        wait_for(lambda: set(submit.futures) == {"a", "b", "c", "d", "e"})
    finally:
        t0 = time.monotonic()
        bridge.stop()
        assert time.monotonic() - t0 < 1.0 and not bridge._thread.is_alive()


def test_bridge_unordered_delivers_as_ready_and_skips_junk() -> None:
    requests: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue(maxsize=8)
    submit = HeldSubmit()
    bridge = QueueBridge(requests, results, submit, capacity=8)
    bridge.start()
    try:
        requests.put(torch.tensor([1, 2]))
        requests.put(object())
        requests.put(EmbedRequest("x", torch.tensor([3])))
        wait_for(lambda: len(submit.futures) == 2)
        submit.resolve("x")
        assert results.get(timeout=1).request_id == "x"
        submit.resolve("0")  # the tensor: its arrival number
        assert results.get(timeout=1).request_id == "0"
        assert bridge.ignored_items == 1 and bridge.in_flight == 0
    finally:
        bridge.stop()
