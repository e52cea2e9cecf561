"""EngineCore driven directly (no processes): batching, pruning, errors, routing, cost model."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.core import EngineCore, MicroBatch, Reply
from quiver_serve.engine.core.fill import ExpectedFill
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import build_model
from quiver_serve.routing.cost import CostModel, LatencyModel
from quiver_serve.routing.router import EngineRouter, EngineRouteState
from quiver_serve.wire import NO_SEED, MicroBatchDone
from tests.conftest import small_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_core(cora: GraphData, device: str = "cpu", **overrides: object) -> EngineCore:
    cfg = small_config(model__weights=None, inference__device=device, **overrides)
    return build_core(cfg, cora, 0, None)


def mb(seq: int, requests: list[list[int]], exact: bool = False, seed: int = NO_SEED,
       deadline_s: float | None = None) -> MicroBatch:
    ids = np.array([i for r in requests for i in r], dtype=np.int64)
    lengths = np.array([len(r) for r in requests], dtype=np.int64)
    deadlines = np.full(len(requests), deadline_s or time.time() + 30.0)
    return MicroBatch(f"c{seq % 3}".encode(), seq, exact, seed, ids, lengths, deadlines)


def run(core: EngineCore, *mbs: MicroBatch, timeout_s: float = 30.0) -> dict[int, Reply]:
    replies: dict[int, Reply] = {}
    for m in mbs:
        refused = core.add(m)
        if refused is not None:
            replies[m.seq] = refused
    end = time.monotonic() + timeout_s
    while len(replies) < len(mbs) and time.monotonic() < end:
        answered = core.step()
        for r in answered:
            replies[r.done.seq] = r
        if not answered and not (core.waiting or core.sampled or core.in_flight):
            time.sleep(0.001)  # as the daemon's loop polls its socket (engine_proc.run): a loop
            # spinning on the interpreter lock would starve the table's refresh thread
    assert len(replies) == len(mbs), "not every micro-batch was answered"
    return replies


@pytest.fixture(scope="module")
def full_output(cora: GraphData) -> torch.Tensor:
    model = build_model(small_config(model__weights=None).model, cora.num_features)
    with torch.no_grad():
        return model(cora.x, cora.edge_index())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table", ["on", "off"])  # from the exact table, or computed on the fly
def test_merged_micro_batches_each_get_their_rows_in_order(cora: GraphData, full_output: torch.Tensor,
                                                           device: str, table: str) -> None:
    core = make_core(cora, device, exact__materialize=table)
    assert (core.exact_table is not None) == (table == "on")
    mbs = [mb(i, [[i, 2707 - i], [5, 5, 9]], exact=True) for i in range(6)]
    replies = run(core, *mbs)
    for m in mbs:
        r = replies[m.seq]
        assert not r.done.errors and r.rows is not None and r.rows.shape == (5, 64)
        np.testing.assert_allclose(r.rows, full_output[torch.from_numpy(m.ids)].numpy(),
                                   atol=1e-4, rtol=1e-4)
    stats = [r.done.stats for r in replies.values() if r.done.stats is not None]
    assert sum(s.num_requests for s in stats) == 12  # each batch's stats are reported once


def test_waiting_micro_batches_form_one_batch_up_to_the_cap(cora: GraphData) -> None:
    core = make_core(cora, batching__max_batch_nodes=100)
    replies = run(core, *[mb(i, [list(range(i * 10, i * 10 + 10))]) for i in range(25)])
    sizes = sorted(r.done.stats.num_seeds for r in replies.values() if r.done.stats)
    assert sum(sizes) == 250 and max(sizes) <= 100 and len(sizes) <= 4  # merged, capped


def test_a_small_batch_waits_briefly_for_the_rest_of_its_usual_size(cora: GraphData) -> None:
    """Expected fill: callers that come back together share one batch (not two alternating)."""
    core = make_core(cora, batching__expected_fill=True)
    assert core.former.expected_fill
    for i in range(5):
        run(core, mb(i, [list(range(100))]))
    assert core.former.fill.recent_ids == pytest.approx(100)
    assert core.former.fill.target_ids(4096) == pytest.approx(98)
    core.former.fill.max_wait_s = 60.0
    core.former.fill.quiet_s = 0.2  # generous: a slow CI box must not see a pause between add and step
    core.latency.fixed_s = 1.0  # the fixed cost a merge saves is no tighter bound here
    core.add(mb(10, [list(range(10))]))
    assert core.step() == [] and len(core.waiting) == 1  # 10 ids of a usual 100: held
    core.add(mb(11, [list(range(10, 90))]))
    assert core.step() == []  # 90 of 98 and still arriving: held
    time.sleep(1.5 * core.former.fill.quiet_s)
    replies = {r.done.seq: r for r in core.step()}  # arrivals paused with >= 75%: formed
    assert sorted(replies) == [10, 11]
    stats = [r.done.stats for r in replies.values() if r.done.stats]
    assert len(stats) == 1 and stats[0].num_seeds == 90  # both in one batch
    core.add(mb(13, [list(range(100))]))
    assert 13 in {r.done.seq for r in core.step()}  # the usual size: formed at once
    core.former.fill.max_wait_s = 0.02
    core.latency.fixed_s = 1.0
    t0 = time.monotonic()
    assert run(core, mb(12, [[1]]))[12].rows is not None  # alone: formed after the short hold
    assert time.monotonic() - t0 >= 0.02


def test_expected_fill_auto_is_on_for_a_cpu_engine_core_and_off_on_a_gpu(cora: GraphData) -> None:
    from quiver_serve.engine.core.build import expected_fill_for

    assert make_core(cora).former.expected_fill  # the default, auto, on the CPU
    assert expected_fill_for("auto", torch.device("cpu"))
    assert not expected_fill_for("auto", torch.device("cuda", 0))
    assert expected_fill_for(True, torch.device("cuda", 0))
    assert not expected_fill_for(False, torch.device("cpu"))
    assert small_config(batching__expected_fill="auto").batching.expected_fill == "auto"


def test_without_expected_fill_a_small_batch_forms_from_what_waits(cora: GraphData) -> None:
    """``batching.expected_fill: false`` (auto's choice on a GPU): no hold, whatever the
    usual size."""
    core = make_core(cora, batching__expected_fill=False)
    assert not core.former.expected_fill
    for i in range(5):
        run(core, mb(i, [list(range(100))]))
    assert core.former.fill.target_ids(4096) == pytest.approx(98)  # what a hold would wait for
    core.former.fill.max_wait_s = 60.0
    core.latency.fixed_s = 30.0  # a hold would last until the deadline's slack is gone
    t0 = time.monotonic()
    assert run(core, mb(10, [list(range(10))]), timeout_s=20.0)[10].rows is not None
    assert time.monotonic() - t0 < 5.0 and not core.former.fill.holding


def test_expected_fill_merges_alternating_groups_and_backs_off_when_holds_miss() -> None:
    fill = ExpectedFill(max_wait_s=1e-3)
    fill.on_formed(1536)
    fill.on_answered(1536, held_ids=1536)  # two groups of callers alternate
    assert fill.target_ids(8192) == pytest.approx(fill.fraction * 3072)
    assert not fill.ready(1536, 8192, now_s=0.0, saving_s=5e-3, slack_s=1.0, device_busy=True)
    assert not fill.holding  # the device still computes: waiting costs nothing, no clock yet
    assert not fill.ready(1536, 8192, now_s=0.0, saving_s=5e-3, slack_s=1.0)  # wait for the rest
    assert fill.holding
    assert not fill.ready(2800, 8192, now_s=2e-4, saving_s=5e-3, slack_s=1.0, last_arrival_s=1e-4)
    assert fill.ready(3050, 8192, now_s=3e-4, saving_s=5e-3, slack_s=1.0, last_arrival_s=3e-4)
    assert fill.hit_rate == 1.0  # they came back: a hit
    assert not fill.ready(2400, 8192, now_s=0.5, saving_s=5e-3, slack_s=1.0, last_arrival_s=0.5)
    assert fill.ready(2400, 8192, now_s=0.5 + 1e-3, saving_s=5e-3, slack_s=1.0,
                      last_arrival_s=0.5)  # 78% and nothing new for a while: settled, a hit
    assert fill.hit_rate == 1.0
    assert not fill.ready(100, 8192, now_s=1.0, saving_s=5e-3, slack_s=1e-4, last_arrival_s=1.0)
    assert fill.ready(100, 8192, now_s=1.0 + 2e-4, saving_s=5e-3, slack_s=1e-4)  # deadline slack
    t = 2.0
    while fill.hit_rate >= fill.min_hit_rate:  # open loop: holds keep timing out
        assert not fill.ready(1536, 8192, now_s=t, saving_s=5e-3, slack_s=1.0)
        assert fill.ready(1536, 8192, now_s=t + 1.1e-3, saving_s=5e-3, slack_s=1.0)
        t += 1.0
    assert fill.target_ids(8192) == pytest.approx(fill.fraction * 1536)  # only the recent batch size
    assert fill.ready(1536, 8192, now_s=t, saving_s=5e-3, slack_s=1.0)  # no wait
    for _ in range(20):
        fill.on_formed(1536)
    assert fill.hit_rate >= fill.min_hit_rate  # probes again later


def test_clients_report_what_they_have_outstanding(cora: GraphData) -> None:
    """Callers between two requests are invisible to the engine; their client counts them."""
    import msgspec

    from quiver_serve.wire import Decoders

    core = make_core(cora)
    a, b = mb(0, [[1, 2]]), mb(1, [[3]])
    a.outstanding_ids, b.outstanding_ids = 500, 700  # clients c0 and c1
    run(core, a, b)
    assert core.former.fill.system_ids == pytest.approx(1200)  # not the 3 ids the engine saw
    assert core.former.fill.target_ids(4096) == pytest.approx(core.former.fill.fraction * 1200)
    assert core.former.clients_outstanding(time.time() + 5.0) == 0  # silent clients are forgotten
    old_header = msgspec.msgpack.encode([7, False, -1])  # a client that does not report
    assert Decoders.micro_batch.decode(old_header).outstanding_ids == 0


def test_client_reports_per_engine_what_it_has_there_plus_a_share_of_the_unsent() -> None:
    """With two engines a client's groups of callers stick to the engine that answered them;
    reporting half of everything made each engine wait for ids that went to the other one."""
    from types import SimpleNamespace

    from quiver_serve.engine.client.client import EngineClient

    two = SimpleNamespace(_pending_ids=1000, _load=[700, 100])  # 200 ids not sent yet
    assert EngineClient._share(two, 0) == 800  # type: ignore[arg-type]
    assert EngineClient._share(two, 1) == 200  # type: ignore[arg-type]
    one = SimpleNamespace(_pending_ids=1000, _load=[700])
    assert EngineClient._share(one, 0) == 1000  # type: ignore[arg-type]  # every pending id
    raced = SimpleNamespace(_pending_ids=600, _load=[700])  # an answer counted before its send
    assert EngineClient._share(raced, 0) == 700  # type: ignore[arg-type]


def test_seeded_micro_batch_is_a_batch_of_its_own_and_reproducible(cora: GraphData) -> None:
    core = make_core(cora)
    a = run(core, mb(0, [[1, 2, 3]]), mb(1, [[10, 20]], seed=7), mb(2, [[4]]))
    b = run(core, mb(3, [[10, 20]], seed=7))
    assert a[1].done.stats is not None and a[1].done.stats.num_seeds == 2
    np.testing.assert_array_equal(a[1].rows, b[3].rows)


def test_expired_and_invalid_requests_are_answered_without_work(cora: GraphData) -> None:
    core = make_core(cora)
    past = time.time() - 1.0
    replies = run(core, mb(0, [[1], [2]], deadline_s=past))
    assert [e.status for e in replies[0].done.errors] == [504, 504]
    assert replies[0].done.stats is None and replies[0].rows is None  # nothing computed
    mixed = run(core, mb(1, [[1, 2], [5000], [-3, 4]]))[1]
    assert {e.index: e.status for e in mixed.done.errors} == {1: 400, 2: 400}
    assert "5000" in mixed.done.errors[0].message and "-3" in mixed.done.errors[1].message
    assert mixed.rows is not None and mixed.rows.shape == (5, 64) and np.abs(mixed.rows[:2]).sum() > 0


def test_malformed_micro_batch_is_refused(cora: GraphData) -> None:
    core = make_core(cora)
    bad = MicroBatch(b"x", 9, False, NO_SEED, np.arange(3), np.array([5]), np.array([time.time() + 9]))
    reply = core.add(bad)
    assert reply is not None and reply.done.errors[0].status == 400


def test_a_failing_batch_answers_500_with_an_error_id_and_the_engine_goes_on(
        cora: GraphData, caplog: pytest.LogCaptureFixture) -> None:
    core = make_core(cora)
    real = core.primary.served

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("secret internal detail")

    core.primary.served = broken  # type: ignore[assignment]
    reply = run(core, mb(0, [[1], [2]]))[0]
    core.primary.served = real
    errs = reply.done.errors
    assert [e.status for e in errs] == [500, 500]
    assert "secret" not in errs[0].message and "id " in errs[0].message
    error_id = errs[0].message.split("id ")[1].split(")")[0]
    assert error_id in caplog.text and "secret internal detail" in caplog.text
    assert not run(core, mb(1, [[3]]))[1].done.errors


def test_engine_queue_is_bounded(cora: GraphData) -> None:
    core = make_core(cora, batching__queue_capacity=2)
    assert core.add(mb(0, [[1]])) is None and core.add(mb(1, [[1]])) is None
    refused = core.add(mb(2, [[1]]))
    assert refused is not None and refused.done.errors[0].status == 503


def test_latency_model_fits_a_line_and_sizes_batches() -> None:
    model = LatencyModel()
    for n in (1, 10, 100, 1000, 5000) * 40:  # more than the window: old points leave the sums
        model.observe(n, 0.5e-3 + 2e-6 * n)
    assert model.predict_s(2000) == pytest.approx(4.5e-3, rel=1e-3)
    assert model.max_seeds_within(4.5e-3, cap=8192) == pytest.approx(2000, abs=1)
    assert model.max_seeds_within(1.0, cap=8192) == 8192
    assert model.max_seeds_within(0.0, cap=8192) == 1  # never refuses the oldest request
    flat = LatencyModel()
    for _ in range(3):
        flat.observe(64, 2e-3)  # one size seen: the fixed term takes it all
    assert flat.predict_s(64) == pytest.approx(2e-3, rel=1e-6)


def test_batches_of_one_size_cannot_tilt_a_calibrated_line() -> None:
    """Decision 0003's case (workload c): one-seed GPU batches (1.3 ms each, staging for
    CUDA graphs included) filled the GPU path's window; the refit line predicted 306 ms for a
    384-seed batch that takes 0.3 ms, and route auto sent every later batch to the C++ sampler
    in the engine (5 ms) without ever trying the GPU again. With the calibrated line as an anchor
    the GPU keeps its slope and wins the large batch."""
    rng = np.random.default_rng(0)
    cost = CostModel({"gpu": (1.665e-4, 0.856e-9), "local": (0.0, 67.979e-9)},
                     x_range=(276.0, 221_354.0))
    for x in rng.uniform(12_000, 147_000, 300):  # workload a: large batches on the GPU
        cost.observe_sample("gpu", int(x), 2.5e-4 + 1e-9 * x)
    for x in rng.integers(40, 600, 132):  # then single seeds, staged for a CUDA graph
        cost.observe_sample("gpu", int(x), 1.29e-3 + 2e-6 * (x - 276) + rng.normal(0, 1e-4))
    for x in rng.integers(3_000, 5_000, 200):  # and 16-seed batches on the engine's C++ sampler
        cost.observe_sample("local", int(x), 2.9e-4 + rng.normal(0, 2e-5))
    assert cost.sample_s("gpu", 65_638) < 3e-3  # 306 ms before the anchor
    assert cost.sample_s("local", 65_638) > 2e-3  # not flat: 0.29 ms for any size before
    assert cost.sample_s("gpu", 276) > 5e-4  # the measured one-seed cost is still learnt
    state = EngineRouteState(384, 0, [], on_gpu=True, psgs=65_638.0)
    router = EngineRouter("auto", cost)
    assert router.decide(state).route == "gpu"
    one = EngineRouteState(1, 0, [], on_gpu=True, psgs=276.0)
    assert router.decide(one).route == "local"  # and a single seed stays on the CPU


def route(forced: str = "auto", **state: object) -> str:
    """The router over a hand-written cost model: local 20 us + 0.2 us/node, pool 0.2 ms +
    0.2 us/node, GPU 80 us + 0.005 us/node (the priors)."""
    base = {"num_seeds": 48, "waiting_micro_batches": 0, "pool_outstanding": [0], "on_gpu": False}
    return EngineRouter(forced).decide(EngineRouteState(**{**base, **state})).route  # type: ignore[arg-type]


def test_engine_router_decisions() -> None:
    assert route(psgs=500) == "local"  # CPU box, nothing else waits: sample here (lowest latency)
    assert route(psgs=500, waiting_batches=3) == "cpu"  # more waits: overlap sampling with the model
    assert route(psgs=500, waiting_batches=3, pool_outstanding=[2]) == "local"  # pool busy
    assert route(psgs=500, pool_outstanding=[]) == "local"
    assert route(on_gpu=True, psgs=20_000) == "gpu"
    # tiny batch: the C++ sampler's cost is lower, and sampling here avoids the hop to the pool
    assert route(on_gpu=True, psgs=30) == "local"
    assert route(on_gpu=True, psgs=30, pool_outstanding=[5]) == "local"
    assert route("gpu", on_gpu=False) == "local"  # no GPU sampler: CPU here
    assert route("cpu", on_gpu=True, psgs=50_000) in ("cpu", "local")  # never the GPU
    with pytest.raises(ValueError):
        route("fastest")


def test_route_auto_measures_an_unchosen_path_again_when_it_is_close() -> None:
    """A path the router never chooses is never measured; once in EXPLORE_EVERY decisions it gets
    a batch, but only when predicted at most EXPLORE_MAX_EXTRA_S slower than the best."""
    from quiver_serve.routing.router import EXPLORE_EVERY, EXPLORE_MAX_EXTRA_S

    cost = CostModel({"gpu": (1.1e-3, 0.0), "local": (0.0, 70e-9)}, x_range=(276.0, 221_354.0))
    router = EngineRouter("auto", cost)
    close = EngineRouteState(16, 0, [], on_gpu=True, psgs=4_000.0)  # local 0.28 ms, gpu 1.1 ms
    routes = [router.decide(close).route for _ in range(3 * EXPLORE_EVERY + 3)]
    assert routes.count("gpu") == 3 and router.explored == 3
    assert [i for i, r in enumerate(routes) if r == "gpu"] == \
        [EXPLORE_EVERY, 2 * EXPLORE_EVERY + 1, 3 * EXPLORE_EVERY + 2]
    far = EngineRouteState(1, 0, [], on_gpu=True, psgs=276.0)  # the gap is the limit or more
    assert cost.sample_s("gpu", 276.0) - cost.sample_s("local", 276.0) > 0.9 * EXPLORE_MAX_EXTRA_S
    slow = CostModel({"gpu": (5e-3, 0.0), "local": (0.0, 70e-9)}, x_range=(276.0, 221_354.0))
    never = EngineRouter("auto", slow)
    assert {never.decide(far).route for _ in range(2 * EXPLORE_EVERY)} == {"local"}
    assert never.explored == 0
    fixed = EngineRouter("local", cost)  # a fixed mode never explores
    assert {fixed.decide(close).route for _ in range(2 * EXPLORE_EVERY)} == {"local"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uva_engine_with_an_elias_fano_adjacency_cache_answers_as_device_sampling(
        cora: GraphData) -> None:
    """``sampling.gpu_mode: uva`` with the default adjacency cache layout (Elias-Fano) within
    ``gpu_graph_cache_bytes``: seeded batches give the rows device-resident sampling gives."""
    budget = 16 * cora.num_nodes + 24 + cora.indices.numel() * 2  # about a quarter of int64
    uva = make_core(cora, "cuda", sampling__gpu_mode="uva", sampling__gpu_graph_cache_bytes=budget,
                    sampling__route="gpu")
    cache = uva.gpu_sampler.adjacency_cache
    assert cache is not None and cache.index_bits == 0 and cache.num_cached > 0
    device = make_core(cora, "cuda", sampling__gpu_mode="device", sampling__route="gpu")
    rng = np.random.default_rng(1)
    requests = [rng.integers(0, cora.num_nodes, 300).tolist() for _ in range(4)]
    got = [run(core, *[mb(i, [r], seed=77 + i) for i, r in enumerate(requests)])
           for core in (uva, device)]
    for i in range(len(requests)):
        np.testing.assert_allclose(got[0][i].rows, got[1][i].rows, atol=1e-5, rtol=1e-5)


def test_a_finished_batch_is_answered_before_the_next_batch_is_sampled_and_launched(
        cora: GraphData, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launching a batch costs the host a millisecond or more: the callers of a batch the GPU
    finished meanwhile must not wait for it (nor for the next batch's sampling)."""
    core = make_core(cora)
    sent: list[Reply] = []
    core.send_now = sent.extend
    done = [Reply(b"a", MicroBatchDone(1, 0, []), None), Reply(b"b", MicroBatchDone(2, 0, []),
                                                                 None)]
    finished = iter([[done[0]], [done[1]]])
    monkeypatch.setattr(core, "_finish", lambda block: next(finished, []))
    order: list[str] = []

    def route_and_run(batch: object) -> list[Reply]:
        order.append(f"sample with {len(sent)} sent")
        return core._launch(batch)  # type: ignore[arg-type]

    def run_async(batch: object) -> None:
        order.append(f"launch with {len(sent)} sent")

    monkeypatch.setattr(core, "route_and_run", route_and_run)
    monkeypatch.setattr(core, "_compute_stream", object())  # the GPU path: launched async
    monkeypatch.setattr(core, "_run_async", run_async)
    monkeypatch.setattr(core, "stage", lambda batch: None)
    on_gpu = types.SimpleNamespace(expected_done_s=0.0, seeds=torch.zeros(1))  # still running
    core.in_flight.append(on_gpu)  # type: ignore[arg-type]
    assert core.add(mb(7, [[1, 2]])) is None
    assert core.step() == []  # everything went out through send_now
    assert order == ["sample with 1 sent", "launch with 2 sent"]
    assert [r.done.seq for r in sent] == [1, 2]


def test_without_send_now_step_returns_the_finished_batches_replies(
        cora: GraphData, monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(cora)
    reply = Reply(b"a", MicroBatchDone(1, 0, []), None)
    finished = iter([[reply]])
    monkeypatch.setattr(core, "_finish", lambda block: next(finished, []))
    assert core.step() == [reply]


def test_a_micro_batchs_requests_travel_in_one_frame_and_older_senders_still_decode(
        cora: GraphData) -> None:
    from quiver_serve.engine.procs.engine_proc import EngineLoop
    from quiver_serve.wire import MicroBatchHeader, encode, pack_requests, unpack_requests

    ids = [np.array([5, 6, 7]), np.array([], np.int64), np.array([9])]
    deadlines = [time.time() + 1.0, time.time() + 2.0, time.time() + 3.0]
    got = unpack_requests(pack_requests(ids, deadlines).tobytes(), 3)
    assert got[0].tolist() == [5, 6, 7, 9] and got[1].tolist() == [3, 0, 1]
    assert got[2].tolist() == deadlines
    with pytest.raises(ValueError):
        unpack_requests(np.zeros(3, np.int64).tobytes(), 2)  # 2 requests need 4 words at least

    loop = EngineLoop(make_core(cora), None, None, None, None)  # type: ignore[arg-type]
    packed = [b"c", encode(MicroBatchHeader(4, False, NO_SEED, requests=3)),
              pack_requests(ids, deadlines).tobytes()]
    older = [b"c", encode(MicroBatchHeader(4, False, NO_SEED)), np.array([5, 6, 7, 9]).tobytes(),
             np.array([3, 0, 1]).tobytes(), np.array(deadlines).tobytes()]
    for frames in (packed, older):
        m = loop._decode(frames)
        assert isinstance(m, MicroBatch) and m.seq == 4
        assert m.ids.tolist() == [5, 6, 7, 9] and m.lengths.tolist() == [3, 0, 1]
        assert m.deadlines_s.tolist() == deadlines
    short = [b"c", encode(MicroBatchHeader(5, False, NO_SEED, requests=9)), b"\0" * 16]
    refused = loop._decode(short)
    assert isinstance(refused, Reply) and refused.done.seq == 5
    assert refused.done.errors[0].status == 400


def test_received_micro_batches_decode_to_writable_arrays(cora: GraphData) -> None:
    """As the engine loop receives them (ZeroMQ frames, not copied): the ids become the batch's
    seed tensor, which torch must be able to own without a read-only warning."""
    import warnings

    import zmq

    from quiver_serve.engine.procs.engine_proc import EngineLoop
    from quiver_serve.wire import MicroBatchHeader, encode, pack_requests

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        b.bind("inproc://decode-test")
        a.connect("inproc://decode-test")
        a.send_multipart([b"c", encode(MicroBatchHeader(1, False, NO_SEED, requests=1)),
                          pack_requests([np.array([3, 4])], [time.time() + 5.0])])
        assert b.poll(5000)
        core = make_core(cora)
        loop = EngineLoop(core, b, None, None, None)  # type: ignore[arg-type]
        assert loop._take_input() == []
        m = core.waiting[0]
        assert m.client == b"c" and m.ids.tolist() == [3, 4]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.from_numpy(m.ids)
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_an_untyped_core_takes_its_one_type_and_refuses_others(cora: GraphData) -> None:
    core = make_core(cora)
    named, other = mb(1, [[3, 4]]), mb(2, [[3]])
    named.node_type, other.node_type = "node", "paper"
    replies = run(core, named, other)
    assert not replies[1].done.errors and replies[1].rows is not None
    (err,) = replies[2].done.errors
    assert err.status == 400 and "'paper'" in err.message and "'node'" in err.message


def test_a_graph_wide_norm_answers_exact_requests_with_422(cora: GraphData) -> None:
    """A layer norm over all nodes of a graph makes every row depend on the whole graph: exact
    requests are refused by name, never answered from a subgraph as if exact; sampled ones are
    served. A per-node layer norm keeps exact answers."""
    cfg = small_config(model__weights=None, exact__materialize="off")
    cfg.model.kwargs = {**cfg.model.kwargs, "norm": "layer_norm"}
    core = build_core(cfg, cora, 0, None)
    replies = run(core, mb(1, [[3, 4]], exact=True), mb(2, [[3, 4]]))
    (err,) = replies[1].done.errors
    assert err.status == 422 and err.code == "exact_unsupported" and "LayerNorm" in err.message
    assert not replies[2].done.errors
    cfg.model.kwargs["norm_kwargs"] = {"mode": "node"}
    per_node = build_core(cfg, cora, 0, None)
    assert not run(per_node, mb(3, [[3, 4]], exact=True))[3].done.errors
