"""BatchAssembler (plain logic, explicit clock) and the RequestBatcher thread."""

from __future__ import annotations

import queue
import time

import torch

from quiver_serve.engine.batcher import BatchAssembler, RequestBatcher
from quiver_serve.messages import EmbedRequest
from tests.conftest import small_config


def req(rid: str, ids: list[int], exact: bool = False, seed: int | None = None) -> EmbedRequest:
    return EmbedRequest(request_id=rid, node_ids=torch.tensor(ids), exact=exact, seed=seed,
                        submitted_s=100.0)


def test_closes_on_size_and_keeps_request_slices() -> None:
    a = BatchAssembler(max_batch_nodes=4, max_delay_s=1.0, default_timeout_s=5.0)
    assert a.add(req("a", [1, 2]), 0.0) == []
    closed = a.add(req("b", [3, 3]), 0.0)
    assert len(closed) == 1
    b = closed[0]
    assert b.request_ids == ["a", "b"] and b.offsets == [0, 2, 4]
    assert b.node_ids.tolist() == [1, 2, 3, 3]
    assert b.deadlines_s == [105.0, 105.0]  # submitted_s + default timeout


def test_request_that_would_overflow_starts_a_new_batch() -> None:
    a = BatchAssembler(max_batch_nodes=4, max_delay_s=1.0, default_timeout_s=5.0)
    a.add(req("a", [1, 2, 3]), 0.0)
    closed = a.add(req("b", [4, 5]), 0.0)
    assert [c.request_ids for c in closed] == [["a"]]
    assert [c.request_ids for c in a.flush()] == [["b"]]


def test_oversized_request_is_a_batch_of_its_own() -> None:
    a = BatchAssembler(max_batch_nodes=2, max_delay_s=1.0, default_timeout_s=5.0)
    closed = a.add(req("big", list(range(10))), 0.0)
    assert [c.request_ids for c in closed] == [["big"]]


def test_closes_on_delay_only_after_max_delay() -> None:
    a = BatchAssembler(max_batch_nodes=100, max_delay_s=0.010, default_timeout_s=5.0)
    a.add(req("a", [1]), 0.000)
    a.add(req("b", [2]), 0.005)
    assert a.poll(0.009) == []
    assert a.next_due_s() == 0.010
    closed = a.poll(0.010)
    assert [c.request_ids for c in closed] == [["a", "b"]]
    assert a.next_due_s() is None


def test_seeded_requests_alone_and_exact_apart() -> None:
    a = BatchAssembler(max_batch_nodes=100, max_delay_s=1.0, default_timeout_s=5.0)
    a.add(req("s1", [1]), 0.0)
    seeded = a.add(req("seeded", [2], seed=7), 0.0)
    assert [(c.request_ids, c.seed) for c in seeded] == [(["seeded"], 7)]
    a.add(req("x", [3], exact=True), 0.0)
    a.add(req("s2", [4]), 0.0)
    batches = {tuple(c.request_ids): c.exact for c in a.flush()}
    assert batches == {("s1", "s2"): False, ("x",): True}


def test_unseeded_batches_get_fresh_seeds() -> None:
    a = BatchAssembler(max_batch_nodes=1, max_delay_s=1.0, default_timeout_s=5.0)
    seeds = {a.add(req(str(i), [i]), 0.0)[0].seed for i in range(20)}
    assert len(seeds) == 20


def test_request_batcher_thread_accepts_requests_and_tensors() -> None:
    cfg = small_config(batching__max_delay_ms=1.0, batching__max_batch_nodes=1000)
    stream: queue.Queue = queue.Queue()
    batcher = RequestBatcher(cfg, stream)
    try:
        stream.put(req("a", [1, 2]))
        stream.put(torch.tensor([5]))
        stream.put("not a request")
        out = batcher.batched_request_queue_list()[0]
        got: list[str] = []
        end = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < end:
            try:
                got += out.get(timeout=0.5).request_ids
            except queue.Empty:
                pass
        assert got[0] == "a" and len(got) == 2  # the tensor got its arrival number as id
        assert batcher.dropped_items == 1
    finally:
        batcher.stop()


def test_batcher_skips_requests_answered_while_waiting() -> None:
    cfg = small_config(batching__max_delay_ms=200.0, batching__adaptive=False)
    stream: queue.Queue = queue.Queue()
    live = {"a", "b"}
    batcher = RequestBatcher(cfg, stream, is_live=lambda rid: rid in live)
    try:
        stream.put(req("a", [1, 2]))
        stream.put(req("b", [3]))
        stream.put(req("gone", [4]))  # answered before it even reached the batcher
        time.sleep(0.05)
        live.discard("a")  # cancelled while its batch was open
        b = batcher.batched_request_queue_list()[0].get(timeout=5)
        assert b.request_ids == ["b"] and b.node_ids.tolist() == [3] and b.offsets == [0, 1]
        assert batcher.skipped_requests == 2
    finally:
        batcher.stop()
