"""Stage logic without processes: pruning, sampling engine, inference engine."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
from torch_geometric.nn.models import GraphSAGE

from quiver_serve.engine.work import InferenceEngine, SamplingEngine, prune_batch
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchedRequest, EmbedResult
from quiver_serve.models import ServedModel
from quiver_serve.sampling.reference import ReferenceSampler


def batch(parts: list[list[int]], deadlines: list[float] | None = None, exact: bool = False) -> BatchedRequest:
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + len(p))
    return BatchedRequest(
        batch_id=1, request_ids=[f"r{i}" for i in range(len(parts))], offsets=offsets,
        node_ids=torch.tensor([i for p in parts for i in p]), exact=exact, seed=3,
        deadlines_s=deadlines or [time.time() + 60] * len(parts),
    )


def engine(g: GraphData, fanouts: list[int]) -> InferenceEngine:
    torch.manual_seed(0)
    model = GraphSAGE(g.num_features, 16, len(fanouts), 8).eval()
    sampling = SamplingEngine(ReferenceSampler(g.indptr, g.indices), fanouts, g.num_nodes)
    return InferenceEngine(ServedModel(model, g.degree()), g.x, torch.device("cpu"), sampling)


def test_prune_drops_expired_and_invalid_requests_only(cora: GraphData) -> None:
    now = time.time()
    b = batch([[1, 2], [5000], [3], [-1]], deadlines=[now + 9, now + 9, now - 1, now + 9])
    kept, failed = prune_batch(b, cora.num_nodes, now)
    assert kept is not None and kept.request_ids == ["r0"] and kept.node_ids.tolist() == [1, 2]
    by_id = {r.request_id: r.error for r in failed}
    assert by_id["r1"].status == 400 and "5000" in by_id["r1"].message and "0..2707" in by_id["r1"].message
    assert by_id["r2"].status == 504
    assert by_id["r3"].status == 400 and "-1" in by_id["r3"].message


def test_engine_answers_each_request_with_its_rows_in_order(cora: GraphData) -> None:
    eng = engine(cora, [-1, -1])
    results = eng.step(batch([[4, 9, 4], [2707]], exact=True))
    assert [r.request_id for r in results] == ["r0", "r1"]
    full = eng.model.model(cora.x, cora.edge_index())
    assert torch.allclose(results[0].embeddings, full[[4, 9, 4]], atol=1e-5)
    assert torch.allclose(results[1].embeddings, full[[2707]], atol=1e-5)
    assert results[0].stats is not None and results[1].stats is None  # stats once per batch
    assert results[0].stats.num_seeds == 4 and results[0].stats.num_requests == 2


def test_engine_failure_fails_its_batch_only(cora: GraphData, caplog: pytest.LogCaptureFixture) -> None:
    eng = engine(cora, [3, 3])

    def broken(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom at /srv/secret/path")

    good = eng.step(batch([[1]]))
    eng._gather = broken
    with caplog.at_level(logging.ERROR, logger="quiver_serve.engine.work"):
        bad = eng.step(batch([[1], [2]]))
    assert good[0].ok
    assert [r.error.status for r in bad] == [500, 500]
    # The client sees an error id, not the exception; the log has the exception under that id.
    message = bad[0].error.message
    assert "boom" not in message and "RuntimeError" not in message and "/srv" not in message
    error_id = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\); see the server log", message)
    assert error_id is not None and bad[1].error.message == message
    (record,) = [r for r in caplog.records if error_id.group(1) in r.getMessage()]
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])


def test_engine_passes_upstream_errors_through(cora: GraphData) -> None:
    eng = engine(cora, [3, 3])
    err = EmbedResult("x", error=None)
    assert eng.step(err) == [err]


def test_result_batch_round_trip_keeps_every_result(cora: GraphData) -> None:
    import pickle

    from quiver_serve.messages import ResultBatch

    eng = engine(cora, [3, 3])
    now = time.time()
    results = eng.step(batch([[4, 9, 4], [2707], [99999]], deadlines=[now + 60] * 3))
    packed = pickle.loads(pickle.dumps(ResultBatch.pack(results)))
    back = {r.request_id: r for r in packed.unpack()}
    before = {r.request_id: r for r in results}
    assert set(back) == {"r0", "r1", "r2"}
    assert torch.equal(back["r0"].embeddings, before["r0"].embeddings)
    assert torch.equal(back["r1"].embeddings, before["r1"].embeddings)
    assert back["r2"].error.status == 400
    assert sum(r.stats is not None for r in back.values()) == 1
