"""Exact mode equals PyG's full-graph output for every supported model class."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import models as pyg_models

from quiver_serve.config import ModelConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import ServedModel, build_model, model_metadata
from quiver_serve.sampling.reference import ReferenceSampler


@pytest.mark.parametrize(("cls", "kwargs"), [("GraphSAGE", {}), ("GCN", {}),
                                             ("GCN", {"improved": True}), ("GAT", {})])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_exact_mode_equals_full_graph(cora: GraphData, cls: str, kwargs: dict, layers: int) -> None:
    """On Cora; tests/models/test_exact_fidelity.py covers self loops, duplicates and isolated nodes."""
    torch.manual_seed(layers)
    model = getattr(pyg_models, cls)(cora.num_features, 32, layers, 8, **kwargs).eval()
    seeds = torch.tensor([0, 5, 5, 2707, 1200])
    out = ReferenceSampler(cora.indptr, cora.indices).sample(seeds, [-1] * layers, seed=0)
    served = ServedModel(model, cora.degree(), cora.self_loop_count())
    emb = served(cora.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                 out.num_sampled_edges, exact=True)[out.seed_index]
    with torch.no_grad():
        full = model(cora.x, cora.edge_index())[seeds]
    torch.testing.assert_close(emb, full, atol=1e-5, rtol=1e-5)


def test_build_model_loads_weights_only_and_rejects_mismatch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig(pyg_class="GCN", kwargs={"hidden_channels": 8, "num_layers": 2, "out_channels": 4},
                      weights=None)
    model = build_model(cfg, in_channels=10)
    path = tmp_path / "w.pt"
    torch.save(model.state_dict(), path)
    loaded = build_model(cfg.model_copy(update={"weights": str(path)}), in_channels=10)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="does not match"):
        build_model(cfg.model_copy(update={"weights": str(path), "pyg_class": "GraphSAGE"}), 10)
    with pytest.raises(ValueError, match="in_channels"):
        build_model(cfg.model_copy(update={"kwargs": {**cfg.kwargs, "in_channels": 3}}), 10)


def test_pickled_objects_in_weights_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "evil.pt"
    torch.save({"x": object()}, path)
    cfg = ModelConfig(weights=str(path))
    with pytest.raises(Exception, match="(?i)weights only|unsupported|not allowed"):
        build_model(cfg, in_channels=1433)


def test_metadata_rebuilds_the_model() -> None:
    cfg = ModelConfig()
    meta = model_metadata(cfg, 1433)
    assert meta["pyg_model"]["class"] == "GraphSAGE"
    assert meta["pyg_model"]["kwargs"]["in_channels"] == 1433
    assert meta["state_dict"] == "quiver_serve/defaults/cora_graphsage.pt"  # package data
