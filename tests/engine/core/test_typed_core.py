"""The typed engine core (engine/core/typed_core.py) on the shipped typed Cora
(configs/cora_typed.yaml): exact answers equal the library's layer-wise rows, seeded answers the
typed sampler and model for that seed, and a wrong node type or id is refused by name."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.micro_batch import MicroBatch
from quiver_serve.engine.core.typed_core import build_typed_core, is_typed
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.sampling.typed import TypedReferenceSampler
from quiver_serve.wire import NO_SEED

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "cora_typed.yaml"


@pytest.fixture(scope="module")
def core_and_graph():
    cfg = ServeConfig.from_yaml(CONFIG)
    graph = load_typed_graph(cfg.graph)
    return build_typed_core(cfg, graph), graph, cfg


def _mb(seq: int, ids: list[int], node_type: str, exact: bool = False,
        seed: int = NO_SEED) -> MicroBatch:
    arr = np.array(ids, np.int64)
    mb = MicroBatch(b"c", seq, exact, seed, arr, np.array([arr.size], np.int64),
                    np.array([time.time() + 30.0]))
    mb.node_type = node_type
    return mb


def _answer(core, mb):
    refused = core.add(mb)
    if refused is not None:
        return refused
    replies = []
    while core.busy():
        replies += core.step()
    assert len(replies) == 1
    return replies[0]


def test_the_config_is_typed(core_and_graph) -> None:
    _, graph, cfg = core_and_graph
    assert is_typed(graph, ModelSpec.from_config(cfg.model))


def test_exact_rows_are_the_layerwise_rows_of_each_type(core_and_graph) -> None:
    core, graph, _ = core_and_graph
    assert core.table is not None
    full = TypedLayerwise(core.served).run(chunk_nodes=500)
    ids = [0, 5, 2707, 5]
    reply = _answer(core, _mb(1, ids, "paper", exact=True))
    assert not reply.done.errors and reply.done.dim == 64
    np.testing.assert_allclose(reply.rows, full["paper"][ids].numpy(), rtol=0, atol=1e-5)
    # on the fly (no table): a sample with every fanout -1 is the same rows
    table = core.table
    core.table = None
    try:
        again = _answer(core, _mb(2, ids, "paper", exact=True))
    finally:
        core.table = table
    np.testing.assert_allclose(again.rows, full["paper"][ids].numpy(), rtol=0, atol=1e-5)


def test_seeded_rows_are_the_typed_sampler_and_model_for_that_seed(core_and_graph) -> None:
    core, graph, cfg = core_and_graph
    ids = [3, 17, 3, 1000]
    reply = _answer(core, _mb(3, ids, "paper", seed=1234))
    out = TypedReferenceSampler(graph).sample("paper", torch.tensor(ids), cfg.sampling.fanouts,
                                              seed=1234)
    with torch.no_grad():
        expected = core.served(out).numpy()
    np.testing.assert_allclose(reply.rows, expected, rtol=0, atol=1e-5)
    other = _answer(core, _mb(4, ids, "paper", seed=99))
    assert not np.allclose(other.rows, reply.rows)  # the seed decides the sample


def test_word_rows_and_batching_by_type(core_and_graph) -> None:
    core, graph, _ = core_and_graph
    full = TypedLayerwise(core.served).run(chunk_nodes=500)
    a, b = _mb(5, [1, 2], "word", exact=True), _mb(6, [7], "paper", exact=True)
    assert core.add(a) is None and core.add(b) is None
    replies = []
    while core.busy():
        replies += core.step()
    by_seq = {r.done.seq: r for r in replies}
    np.testing.assert_allclose(by_seq[5].rows, full["word"][[1, 2]].numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(by_seq[6].rows, full["paper"][[7]].numpy(), atol=1e-5, rtol=0)


def test_a_wrong_type_or_id_is_refused_by_name(core_and_graph) -> None:
    core, _, _ = core_and_graph
    reply = _answer(core, _mb(7, [1], "author"))
    (err,) = reply.done.errors
    assert err.status == 400 and "'author'" in err.message and "paper" in err.message \
        and "word" in err.message
    reply = _answer(core, _mb(8, [1], ""))
    assert reply.done.errors[0].status == 400 and "node_type is required" in \
        reply.done.errors[0].message
    reply = _answer(core, _mb(9, [1500], "word"))  # 1433 words
    (err,) = reply.done.errors
    assert err.status == 400 and "1500" in err.message and "0..1432" in err.message


def test_a_malformed_micro_batch_is_refused(core_and_graph) -> None:
    core, _, _ = core_and_graph
    bad = MicroBatch(b"x", 10, False, NO_SEED, np.arange(3), np.array([5]),
                     np.array([time.time() + 9]))
    bad.node_type = "paper"
    reply = core.add(bad)
    assert reply is not None and reply.done.errors[0].status == 400
    assert "malformed" in reply.done.errors[0].message


def follow_a_log(core, cfg: ServeConfig, graph, tmp_path: Path):  # noqa: ANN001, ANN201
    """A typed graph writer on a fresh update log, and ``core`` following that log: (writer,
    log); the caller closes the log."""
    from quiver_serve.engine.core.typed_sync import TypedSync
    from quiver_serve.graph.living import LiveGraphArgs, capacities
    from quiver_serve.graph.state import GraphState
    from quiver_serve.graph.typed_living import TypedLiveGraph
    from quiver_serve.graph.typed_writer import TypedGraphWriter
    from quiver_serve.graph.update_log import UpdateLog

    state = GraphState()
    log = UpdateLog(tmp_path / "log", "none")
    log.open()
    writer = TypedGraphWriter(cfg.graph, load_typed_graph(cfg.graph), log, state)
    live = LiveGraphArgs(str(tmp_path / "log"), 0, capacities(cfg.graph, 1, 1), state.tensor)
    core.sync = TypedSync(live, TypedLiveGraph(graph, cfg.graph.add_reverse_edges))
    return writer, log


def test_updates_from_the_log_reach_the_core_and_min_version_waits(tmp_path: Path) -> None:
    """A typed core following a real update log: a micro-batch asking for a version not
    applied yet (or a node just added) waits in ``parked``; the step that applies the record
    answers it on the updated graph; one whose deadline passes first is a 504."""
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.exact.materialize = "off"
    graph = load_typed_graph(cfg.graph)
    core = build_typed_core(cfg, graph)
    writer, log = follow_a_log(core, cfg, graph, tmp_path)
    waiting = _mb(1, [1433], "word", exact=True)
    waiting.min_version = 2
    late = _mb(2, [0], "paper")
    late.min_version = 3
    late.deadlines_s[:] = time.time() + 0.2
    assert core.add(waiting) is None and core.add(late) is None
    assert len(core.parked) == 2 and core.step() == []
    assert writer.add_nodes(np.zeros((1, 0), np.float32), "word")["node_ids"] == [1433]
    assert writer.add_edges([[7, 1433]], None, ["paper", "has_word", "word"])["version"] == 2
    time.sleep(0.25)
    replies = core.step()
    while core.busy():
        replies += core.step()
    by_seq = {r.done.seq: r for r in replies}
    assert by_seq[2].done.errors[0].status == 504
    assert not by_seq[1].done.errors and core.sync.version == 2
    has, rev = (graph.relations[("paper", "has_word", "word")],
                graph.relations[("word", "rev_has_word", "paper")])
    assert graph.num_nodes["word"] == 1434
    assert has.indices[int(has.indptr[1433]):].tolist() == [7]
    assert 1433 in rev.indices[int(rev.indptr[7]):int(rev.indptr[8])].tolist()
    full = TypedLayerwise(core.served).run(chunk_nodes=500)  # the updated graph, layer by layer
    np.testing.assert_allclose(by_seq[1].rows, full["word"][[1433]].numpy(), rtol=0, atol=1e-5)
    log.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_gpu_core_answers_the_updated_graph(tmp_path: Path, device: str) -> None:
    """The typed GPU core (its torch twins on a CPU) following a log: after an update its
    seeded and exact answers are those of the updated graph (CPU sampling over the host graph
    and host rows from then on)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from quiver_serve.engine.core.typed_gpu import build_typed_gpu_core
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.exact.materialize = "off"
    graph = load_typed_graph(cfg.graph)
    core = build_typed_gpu_core(cfg, graph, device=torch.device(device))
    writer, log = follow_a_log(core, cfg, graph, tmp_path)
    writer.add_edges([[7, 3], [7, 9]], [[int(graph.relations[("paper", "cites", "paper")]
                                            .indices[0]), 0]], ["paper", "cites", "paper"])
    core.step()
    assert core.sync.version == 1 and core.device_stale
    seeded = _answer(core, _mb(1, [0, 3, 7], "paper", seed=5))
    out = TypedReferenceSampler(graph).sample("paper", torch.tensor([0, 3, 7]),
                                              cfg.sampling.fanouts, seed=5)
    np.testing.assert_allclose(seeded.rows, core.served(out).float().cpu().numpy(), atol=1e-5)
    exact = _answer(core, _mb(2, [0, 3, 7], "paper", exact=True))
    full = TypedLayerwise(core.served).run(chunk_nodes=500)
    np.testing.assert_allclose(exact.rows, full["paper"][[0, 3, 7]].cpu().numpy(), atol=1e-5)
    log.close()


def test_a_graph_wide_norm_answers_exact_requests_with_422_and_sampled_ones() -> None:
    """A layer norm over all nodes of a graph makes a row depend on the whole graph: exact
    requests are refused by name (never a wrong "exact" answer); sampled ones are served."""
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.model.weights = None
    cfg.model.kwargs = {**cfg.model.kwargs, "norm": "layer_norm"}
    cfg.exact.materialize = "off"
    core = build_typed_core(cfg, load_typed_graph(cfg.graph))
    (err,) = _answer(core, _mb(1, [3, 4], "paper", exact=True)).done.errors
    assert err.status == 422 and "normalises over all nodes" in err.message
    reply = _answer(core, _mb(2, [3, 4], "paper"))
    assert not reply.done.errors and reply.rows.shape == (2, 64)
