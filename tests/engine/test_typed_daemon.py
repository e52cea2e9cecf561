"""The daemon on a typed graph (configs/cora_typed.yaml) through the queue API: requests name
a node type, exact answers equal the library's layer-wise rows, seeded answers the typed sampler
and model for that seed, and a wrong type or id is a 400 naming what was wrong."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.models.typed_served import build_typed_model
from quiver_serve.sampling.typed import TypedReferenceSampler

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cora_typed.yaml"


def typed_config() -> ServeConfig:
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.server.start_timeout_s = 180.0
    cfg.server.http_workers = 1
    cfg.graph.update_log_dir = tempfile.mkdtemp(prefix="quiver-log-")
    return cfg


def typed_library() -> tuple:
    """The typed Cora, its served model, every node's exact rows (the library's) and the
    config: what the daemon's answers are compared with."""
    cfg = typed_config()
    graph = load_typed_graph(cfg.graph)
    served = build_typed_model(ModelSpec.from_config(cfg.model), graph)
    return graph, served, TypedLayerwise(served).run(chunk_nodes=1000), cfg


@pytest.fixture(scope="module")
def library():
    return typed_library()


@pytest.fixture(scope="module")
def pipeline() -> Iterator[Pipeline]:
    pipe = Pipeline(typed_config()).start()
    try:
        yield pipe
    finally:
        pipe.stop()


def test_exact_requests_are_the_layerwise_rows(pipeline: Pipeline, library) -> None:
    _, _, full, _ = library
    assert pipeline.node_types == {"paper": 2708, "word": 1433}
    ids = [0, 9, 2707, 9]
    rows = pipeline.embed(ids, exact=True, node_type="paper")
    torch.testing.assert_close(rows, full["paper"][ids], rtol=0, atol=1e-5)
    rows = pipeline.embed([1432, 0], exact=True, node_type="word")
    torch.testing.assert_close(rows, full["word"][[1432, 0]], rtol=0, atol=1e-5)


def test_seeded_requests_are_the_typed_sample_for_that_seed(pipeline: Pipeline,
                                                            library) -> None:
    graph, served, _, cfg = library
    ids = [4, 40, 400]
    rows = pipeline.embed(ids, seed=77, node_type="paper")
    out = TypedReferenceSampler(graph).sample("paper", torch.tensor(ids), cfg.sampling.fanouts,
                                              seed=77)
    torch.testing.assert_close(rows, served(out), rtol=0, atol=1e-5)


def test_a_wrong_type_or_id_is_a_400_naming_it(pipeline: Pipeline) -> None:
    with pytest.raises(errors.ServeError) as info:
        pipeline.embed([1], node_type="author")
    assert info.value.info.status == 400
    assert "'author'" in info.value.info.message and "paper" in info.value.info.message
    with pytest.raises(errors.ServeError) as info:
        pipeline.embed([1])
    assert info.value.info.status == 400 and "node_type is required" in info.value.info.message
    with pytest.raises(errors.ServeError) as info:
        pipeline.embed([1433], node_type="word")
    assert info.value.info.status == 400 and "0..1432" in info.value.info.message


def test_new_nodes_through_the_queue_api(pipeline: Pipeline, library) -> None:
    """``embed(new_nodes=..., node_type=...)``: a new word with in-neighbours along its one
    relation (a list is enough) answers the rows of the graph with it added."""
    from tests.engine.core.test_typed_inductive import added
    from tests.models.test_typed_models import full_graph

    graph, served, _, _ = library
    new = [({"has_word": [0, 9, 2000]}, [])]
    rows = pipeline.embed(None, exact=True, node_type="word",
                          new_nodes=[{"features": [], "in_neighbors": [0, 9, 2000]}])
    other, first = added(graph, "word", new)
    torch.testing.assert_close(rows, full_graph(served, other)["word"][first], rtol=0,
                               atol=1e-5)
