"""Feature placement scores are a derived table keyed by content (decision 0039): FAP under
uniform seeds is computed once per graph content, fanouts and batch size, and a later start
reads it back; another graph or setting, or a damaged file, is computed afresh."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.features import build
from quiver_serve.graph.csc import GraphData


def _graph(seed: int) -> GraphData:
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, 400, (2, 3000), generator=g)
    return GraphData.from_edge_index(ei, torch.randn(400, 4, generator=g), "g")


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    monkeypatch.setenv("QUIVER_SERVE_CACHE", str(tmp_path))
    calls: list[int] = []
    real = build.feature_access_probability

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(build, "feature_access_probability", counting)
    return calls


def test_scores_are_computed_once_per_graph_and_settings(computed: list[int]) -> None:
    cfg = ServeConfig.default()
    graph = _graph(0)
    first = build.placement_scores(cfg, graph, rank_by="fap", num_rows=450)
    again = build.placement_scores(cfg, graph, rank_by="fap", num_rows=450)
    assert computed == [1] and torch.equal(first, again)
    assert again.shape == (450,) and float(again[400:].abs().sum()) == 0.0
    build.placement_scores(cfg, _graph(1), rank_by="fap")  # another graph
    cfg.features.fap_batch_size += 1  # another setting that shapes the scores
    build.placement_scores(cfg, graph, rank_by="fap")
    assert computed == [1, 1, 1]


def test_a_damaged_cache_file_is_computed_again(computed: list[int]) -> None:
    cfg = ServeConfig.default()
    graph = _graph(0)
    first = build.placement_scores(cfg, graph, rank_by="fap")
    path = build.fap_cache_path(graph, cfg.sampling.fanouts, cfg.features.fap_batch_size)
    path.write_bytes(path.read_bytes()[:40])  # cut short
    assert torch.equal(build.placement_scores(cfg, graph, rank_by="fap"), first)
    np.save(path, np.zeros(3, np.float32))  # another shape under its name
    assert torch.equal(build.placement_scores(cfg, graph, rank_by="fap"), first)
    assert computed == [1, 1, 1]
