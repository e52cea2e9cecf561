"""The pipeline in real processes: facade, queue API, low-level stage API, deadlines, stop."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing as mp

from quiver_serve import (
    EmbedRequest,
    HybridSampler,
    InferenceServer,
    Pipeline,
    RequestBatcher,
    ServeError,
)
from quiver_serve.engine.pipeline import PipelineObserver
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchStats
from quiver_serve.models import build_model
from tests.conftest import small_config

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


def test_low_level_stage_api(cora: GraphData) -> None:
    """The seed's names: batcher → hybrid sampler → inference server, results on their queues."""
    cfg = small_config(model__weights=None, batching__max_delay_ms=1.0)
    stream = mp.get_context("spawn").Queue(maxsize=64)
    batcher = RequestBatcher(cfg, stream)
    sampler = HybridSampler(cfg, cora, batcher.batched_request_queue_list())
    server = InferenceServer(cfg, cora, sampler.sampled_request_queue_list())
    try:
        sampler.start()
        server.start()
        stream.put(torch.tensor([1, 2, 3]))  # bare tensors get their arrival number as id
        stream.put(EmbedRequest(request_id="named", node_ids=torch.tensor([4])))
        results = server.result_queue_list()
        got = {}
        for _ in range(2):
            res = results[0].get(timeout=30)
            got[res.request_id] = res
        assert set(got) == {"0", "named"}
        assert got["0"].embeddings.shape == (3, 64) and got["named"].embeddings.shape == (1, 64)
    finally:
        batcher.stop()
        sampler.stop()
        server.stop()
    assert not any(w.is_alive() for w in sampler.workers + server.workers)


def test_stop_leaves_no_worker_processes(cora: GraphData) -> None:
    p = Pipeline(small_config(model__weights=None), graph=cora).start()
    assert p.supervisor is not None
    children = p.supervisor.children
    assert {c.role for c in children} == {"engine", "sampler"}
    assert all(c.alive() for c in children)
    t0 = time.monotonic()
    p.stop()
    assert time.monotonic() - t0 < 10
    assert not any(c.alive() for c in children)
    with pytest.raises(ServeError) as e:
        p.embed([1])
    assert e.value.info.status == 503
