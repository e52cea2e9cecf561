"""The pipeline in real processes: facade, queue API, deadlines, stop (the seed's stage API:
``test_seed_api.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from quiver_serve import EmbedRequest, Pipeline, ServeError
from quiver_serve.engine.client.pipeline import PipelineObserver
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchStats
from quiver_serve.models.served import build_model
from tests.conftest import small_config
from tests.exact_checks import check_concurrent_exact

pytestmark = pytest.mark.e2e


class CountingObserver(PipelineObserver):
    def __init__(self) -> None:
        self.batches: list[BatchStats] = []
        self.rejected: list[str] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats)

    def on_rejected(self, reason: str) -> None:
        self.rejected.append(reason)


@pytest.fixture(scope="module")
def pipeline(cora: GraphData) -> Iterator[Pipeline]:
    cfg = small_config(model__weights=None, batching__max_delay_ms=1.0)
    p = Pipeline(cfg, graph=cora, observer=CountingObserver()).start()
    yield p
    p.stop()


def test_exact_embeddings_equal_pyg_full_graph(pipeline: Pipeline, cora: GraphData) -> None:
    model = build_model(pipeline.cfg.model, cora.num_features)
    with torch.no_grad():
        full = model(cora.x, cora.edge_index())
    ids = [0, 1, 2707, 1, 1500]
    emb = pipeline.embed(ids, exact=True)
    assert emb.shape == (5, 64)
    torch.testing.assert_close(emb, full[ids], atol=1e-4, rtol=1e-4)


def test_seeded_requests_are_reproducible(pipeline: Pipeline) -> None:
    a = pipeline.embed([10, 20, 30], seed=123)
    b = pipeline.embed([10, 20, 30], seed=123)
    c = pipeline.embed([10, 20, 30], seed=124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_bad_requests_raise_named_errors(pipeline: Pipeline) -> None:
    with pytest.raises(ServeError, match="2708") as e:
        pipeline.embed([2708])
    assert e.value.info.status == 400
    with pytest.raises(ServeError) as e:
        pipeline.embed(list(range(pipeline.cfg.server.max_request_nodes + 1)))
    assert e.value.info.status == 413


def test_queue_api_answers_300_requests_exactly_once(pipeline: Pipeline) -> None:
    q, r = pipeline.request_queue(), pipeline.result_queue()
    for i in range(300):
        q.put(EmbedRequest(request_id=f"q{i}", node_ids=torch.tensor([i, i + 1, i])))
    seen: dict[str, torch.Tensor] = {}
    for _ in range(300):
        res = r.get(timeout=30)
        assert res.ok, res.error
        assert res.request_id not in seen
        seen[res.request_id] = res.embeddings
    assert set(seen) == {f"q{i}" for i in range(300)}
    assert all(e.shape == (3, 64) and torch.equal(e[0], e[2]) for e in seen.values())
    with pytest.raises(Exception):  # noqa: B017 - nothing more arrives
        r.get(timeout=0.5)
    assert pipeline.client is not None and pipeline.client._pending_ids == 0  # told to engines


def test_queue_api_reports_bad_requests_as_results(pipeline: Pipeline) -> None:
    pipeline.request_queue().put(EmbedRequest(request_id="bad", node_ids=torch.tensor([-5])))
    res = pipeline.result_queue().get(timeout=10)
    assert res.request_id == "bad" and res.error.status == 400 and "-5" in res.error.message


def test_expired_deadline_is_answered_504_and_not_computed(pipeline: Pipeline) -> None:
    observer = pipeline.observer
    assert isinstance(observer, CountingObserver)
    time.sleep(0.2)  # let earlier tests' batches settle
    before = len(observer.batches)
    req = pipeline.new_request([1, 2], timeout_s=1e-6)
    time.sleep(0.01)
    result = pipeline.submit(req).result(timeout=5)
    assert result.error is not None and result.error.status == 504
    time.sleep(0.3)
    assert len(observer.batches) == before  # dropped before any sampling or model work
    assert "deadline" in observer.rejected


def test_stop_leaves_no_worker_processes(cora: GraphData) -> None:
    """... and answers what is pending 503: no thread blocked in ``embed`` hangs."""
    import threading

    p = Pipeline(small_config(model__weights=None), graph=cora).start()
    assert p.supervisor is not None
    children = p.supervisor.children
    assert {c.role for c in children} == {"engine", "sampler"}
    assert all(c.alive() for c in children)
    statuses: list[int] = []

    def blocked() -> None:  # waits for a graph version that never comes
        try:
            p.embed([3], min_version=2**62, timeout_s=30.0)
        except ServeError as exc:
            statuses.append(exc.info.status)

    threads = [threading.Thread(target=blocked, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10.0
    while p.pending_count < len(threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    p.stop(drain_timeout_s=0.2)
    for t in threads:
        t.join(timeout=5.0)
    assert statuses == [503] * len(threads)
    assert time.monotonic() - t0 < 10
    assert not any(c.alive() for c in children)
    with pytest.raises(ServeError) as e:
        p.embed([1])
    assert e.value.info.status == 503


def _queue_api_caller(q: object, r: object, out: object) -> None:
    """Another process: 300 requests through the Pipeline's multiprocessing queues."""
    for i in range(300):
        q.put(EmbedRequest(request_id=f"x{i}", node_ids=torch.tensor([i, 7])))  # type: ignore[attr-defined]
    seen = []
    for _ in range(300):
        res = r.get(timeout=60)  # type: ignore[attr-defined]
        seen.append((res.request_id, res.ok, tuple(res.embeddings.shape) if res.ok else None))
    out.put(seen)  # type: ignore[attr-defined]


def test_queue_api_exactly_once_from_another_process(pipeline: Pipeline) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_queue_api_caller,
                       args=(pipeline.request_queue(), pipeline.result_queue(), out))
    proc.start()
    seen = out.get(timeout=120)
    proc.join(timeout=10)
    assert sorted(rid for rid, _, _ in seen) == sorted(f"x{i}" for i in range(300))
    assert all(ok and shape == (2, 64) for _, ok, shape in seen)


def _client_process(endpoints: object, n: int, out: object) -> None:
    """Another process with its own fast-path client (``connect``), asyncio callers."""
    import asyncio

    from quiver_serve.engine.client.pipeline import connect

    client = connect(endpoints)  # type: ignore[arg-type]

    async def go() -> list[int]:
        results = await asyncio.gather(*[client.submit_async(np.array([i % 2708, 3])) for i in range(n)])
        return [r.embeddings.shape[0] if r.ok else -r.error.status for r in results]

    out.put(asyncio.run(go()))  # type: ignore[attr-defined]
    client.stop()


def test_clients_in_other_processes_and_the_death_of_one(pipeline: Pipeline) -> None:
    import os
    import signal

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    doomed = ctx.Process(target=_client_process, args=(pipeline.endpoints(), 200000, ctx.Queue()))
    doomed.start()
    time.sleep(3.0)  # it is submitting / holding requests at the engine core now
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(timeout=10)
    good = ctx.Process(target=_client_process, args=(pipeline.endpoints(), 500, out))
    good.start()
    shapes = out.get(timeout=120)
    good.join(timeout=10)
    assert shapes == [2] * 500  # the engine core served on, unharmed by a client's death
    assert pipeline.embed([1, 2]).shape == (2, 64)
    assert all(w["alive"] and w["restarts"] == 0 for w in pipeline.workers())


def test_two_engine_cores_share_the_load(cora: GraphData) -> None:
    observer = CountingObserver()
    cfg = small_config(model__weights=None, inference__num_workers=2, sampling__num_cpu_workers=0)
    p = Pipeline(cfg, graph=cora, observer=observer).start()
    try:
        futures = [p.submit(p.new_request([i % 2708] * 48)) for i in range(400)]
        assert all(f.result(timeout=60).ok for f in futures)
        assert {s.worker for s in observer.batches} == {0, 1}
        # callers in lock-step (each round: all submit, all wait): every engine core is idle
        # when a round starts, and each round's requests must still be spread over both
        before = list(p.client.answered)
        for _ in range(20):
            round_ = [p.submit(p.new_request([i] * 48)) for i in range(16)]
            assert all(f.result(timeout=60).ok for f in round_)
        per_engine = [a - b for a, b in zip(p.client.answered, before, strict=True)]
        assert min(per_engine) >= 0.3 * sum(per_engine), per_engine
    finally:
        p.stop()


def test_concurrent_exact_requests_equal_pyg(pipeline: Pipeline, cora: GraphData) -> None:
    """Many exact requests in flight at once (merged into batches): every row still exact."""
    check_concurrent_exact(pipeline, cora, 150, 20)


def test_coroutines_are_served_by_their_own_loops_client(pipeline: Pipeline, cora: GraphData) -> None:
    """``embed_async`` runs on a client driven by the caller's event loop (no IO thread): 300
    requests in flight from one loop are each answered once, exact rows equal the sync path's,
    a deadline is answered 504 by the loop's timer, and a closed loop's client is stopped."""
    import asyncio

    from quiver_serve.engine.client.loop_client import LoopClient

    ids = [[i % cora.num_nodes, (7 * i) % cora.num_nodes] for i in range(300)]

    async def many() -> list[torch.Tensor]:
        rows = await asyncio.gather(*(pipeline.embed_async(x, exact=True) for x in ids))
        client = pipeline.async_client()
        assert isinstance(client, LoopClient) and client.pending_count == 0
        with pytest.raises(ServeError) as err:
            await pipeline.embed_async([1, 2], timeout_s=1e-6)
        assert err.value.info.status == 504
        return rows

    rows = asyncio.run(many())
    expect = pipeline.embed(ids[3], exact=True)
    torch.testing.assert_close(rows[3], expect, atol=1e-5, rtol=1e-5)
    assert all(r.shape == (2, 64) for r in rows)
    for _ in range(3):  # each asyncio.run is a new loop: the old loops' clients are let go
        asyncio.run(pipeline.embed_async([5]))
    assert len(pipeline._loop_clients) == 1


def test_transport_trip_is_reported(pipeline: Pipeline) -> None:
    """Each reply's stats carry when the engine core took the micro-batch in and answered it;
    the client adds its send and receive times (the ``transport_seconds`` metric's input)."""
    trips: list[tuple[float, float, float, float]] = []

    class Trips(PipelineObserver):
        def on_transport(self, *t: float) -> None:
            trips.append(t)

    client = pipeline.client
    assert client is not None
    old, client.observer = client.observer, Trips()
    try:
        for i in range(5):
            pipeline.embed([i])
    finally:
        client.observer = old
    assert len(trips) == 5
    for sent, taken, replied, back in trips:
        assert sent <= taken + 1e-3 and taken <= replied <= back + 1e-3  # one clock, in order
        assert back - sent < 5.0


# ---- threads blocked in Pipeline.embed (EngineClient.call; test_sync_callers.py: its parts) ----
def _in_threads(n: int, target: object) -> list[object]:
    """Run ``target(i)`` in ``n`` threads at once; what each returned or raised, by index."""
    import threading

    out: list[object] = [None] * n

    def run(i: int) -> None:
        try:
            out[i] = target(i)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a caller thread hangs"
    return out


def test_64_threads_each_get_their_own_rows(pipeline: Pipeline, cora: GraphData) -> None:
    """64 threads in closed loops, exact and sampled requests mixed in each round (so waves
    of answers and of next requests hold both kinds): every exact answer equals PyG's
    full-graph rows for that thread's own ids, every sampled one has its own shape."""
    model = build_model(pipeline.cfg.model, cora.num_features)
    with torch.no_grad():
        full = model(cora.x, cora.edge_index())
    n = cora.num_nodes

    def caller(t: int) -> int:
        for r in range(6):
            ids = [(t * 41 + r * 7 + j * 13) % n for j in range(1 + (t + r) % 48)]
            if (t + r) % 2:
                torch.testing.assert_close(pipeline.embed(ids, exact=True), full[ids],
                                           atol=1e-4, rtol=1e-4)
            else:
                assert pipeline.embed(ids).shape == (len(ids), 64)
        return t

    assert _in_threads(64, caller) == list(range(64))


def test_blocked_callers_answered_together_send_their_next_requests_together(
        pipeline: Pipeline) -> None:
    """The batching property of the thread client, not its timing: 32 threads in closed loops
    (each asks again as soon as it has its answer) send their requests in waves, about 32 to a
    micro-batch, where each would otherwise leave alone or with a few others as it comes back.
    Counted over a window in the middle of the run. The gate waits here as long as the callers
    take (its quiet time raised to 0.1 s, the longest hold to 1 s), so a slow box cannot split
    a wave."""
    import itertools
    import threading

    client = pipeline.client
    assert client is not None
    gate = client._gate
    saved = (gate.quiet_s, gate.max_hold_s)
    gate.quiet_s, gate.max_hold_s, gate.hit_rate = 0.1, 1.0, 1.0
    stop, answered = threading.Event(), itertools.count()

    def caller(t: int) -> None:
        while not stop.is_set():
            pipeline.embed([t, t + 100, t + 200])
            next(answered)

    def window() -> tuple[int, int]:
        return sum(client.sent), next(answered)

    try:
        callers = threading.Thread(target=_in_threads, args=(32, caller), daemon=True)
        callers.start()
        time.sleep(0.5)
        (sent0, done0) = window()
        time.sleep(0.5)
        (sent1, done1) = window()
    finally:
        stop.set()
        callers.join(timeout=30)
        gate.quiet_s, gate.max_hold_s = saved
    assert not callers.is_alive()
    per_micro_batch = (done1 - done0) / max(sent1 - sent0, 1)
    assert per_micro_batch >= 16 / client.endpoints.num_engines, (sent1 - sent0, done1 - done0)


def test_threads_with_think_time_are_not_waited_for(pipeline: Pipeline) -> None:
    """A thread that pauses (here 5 ms) before it asks again is not expected back at once:
    answering it opens no hold, so its requests never wait for the others'."""
    client = pipeline.client
    assert client is not None
    holds0 = client._gate.holds

    def caller(t: int) -> None:
        for _ in range(5):
            pipeline.embed([t])
            time.sleep(0.005)

    assert _in_threads(8, caller) == [None] * 8
    assert client._gate.holds == holds0


def test_answered_requests_leave_no_deadline_to_wake_for(pipeline: Pipeline) -> None:
    """The IO thread sleeps until the next deadline of a request still unanswered: answered
    ones leave its deadline heap (else it would wake for each of them for
    ``request_timeout_s`` after the load)."""
    client = pipeline.client
    assert client is not None
    def caller(t: int) -> int:
        for i in range(20):
            pipeline.embed([t, i])
        return t

    assert _in_threads(8, caller) == list(range(8))
    deadline = time.monotonic() + 5.0
    while client._deadlines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client._deadlines and client.pending_count == 0


def test_blocked_callers_get_504_at_their_deadline_and_499_when_cancelled(
        pipeline: Pipeline) -> None:
    client = pipeline.client
    assert client is not None

    def late(t: int) -> int:
        with pytest.raises(ServeError) as err:
            pipeline.embed([t, t + 1], timeout_s=1e-6)
        return err.value.info.status

    assert _in_threads(16, late) == [504] * 16
    # a read that waits for a graph version that never comes, cancelled from another thread
    parked = 2**62

    def wait_for_version(_: int) -> object:
        with pytest.raises(ServeError) as err:
            pipeline.embed([5], min_version=parked, timeout_s=5.0)
        return err.value.info.status

    import threading

    statuses: list[object] = []
    thread = threading.Thread(target=lambda: statuses.append(wait_for_version(0)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    rid = None
    while rid is None and time.monotonic() < deadline:
        rid = next((r for r, req in list(client._by_id.items()) if req.min_version == parked), None)
        time.sleep(0.01)
    assert rid is not None and pipeline.cancel(rid)
    thread.join(timeout=5.0)
    assert statuses == [499]
    assert pipeline.embed([1, 2]).shape == (2, 64)  # the client serves on
