"""Models on typed graphs (docs/architecture.md, "Typed graphs"): to_hetero, HeteroConv, RGCN,
HGT, custom typed modules and homogeneous models with edge features are built from a spec, load
their weights after the lazy widths are set, and their exact answers (layer-wise over the full
graph, and through the whole sampled neighbourhood) equal PyG's full-graph forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_geometric.data import HeteroData

from quiver_serve.graph.typed import TypedGraph, add_reverse_edges
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise, unsupported
from quiver_serve.models.typed_served import build_typed_model
from quiver_serve.sampling.typed import TypedReferenceSampler

TOL = 1e-5


def shop_graph(seed: int, edge_dim: int | None = 3) -> TypedGraph:
    """A random typed graph the repository does not hold: users and shops with features,
    items without; relations between types and within one; reverse relations added."""
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    sizes = {"user": 57, "item": 43, "shop": 9}
    data["user"].x = torch.randn(57, 6, generator=g)
    data["item"].num_nodes = 43
    data["shop"].x = torch.randn(9, 3, generator=g)
    for (src, rel, dst), num in ((("user", "buys", "item"), 240), (("user", "knows", "user"), 150),
                                 (("item", "sold_by", "shop"), 43)):
        pairs = torch.unique(torch.stack([torch.randint(0, sizes[src], (num,), generator=g),
                                          torch.randint(0, sizes[dst], (num,), generator=g)]),
                             dim=1)
        data[src, rel, dst].edge_index = pairs
        if edge_dim:
            data[src, rel, dst].edge_attr = torch.randn(pairs.size(1), edge_dim, generator=g)
    return add_reverse_edges(TypedGraph.from_hetero_data(data, f"shop-{seed}"))


def spec(pyg_class: str, kwargs: dict, to_hetero: dict | None = None,
         weights: str | None = None) -> ModelSpec:
    return ModelSpec("typed", 1, pyg_class, kwargs, 2, None, weights, 3, None, None, to_hetero)


def full_graph(served, graph: TypedGraph) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """PyG's own forward on the whole graph, inputs built here (not by the served model)."""
    x = {t: graph.x[t] if t in graph.x else torch.ones(n, 1) for t, n in graph.num_nodes.items()}
    kwargs = {}
    if served.edge_attr_arg == "edge_attr_dict":
        kwargs["edge_attr_dict"] = graph.edge_attr_dict()
    elif served.edge_attr_arg == "edge_attr" and graph.edge_attr_dict():
        kwargs["edge_attr"] = graph.edge_attr_dict()
    if served.takes_ids:
        kwargs["n_id_dict"] = {t: torch.arange(n) for t, n in graph.num_nodes.items()}
    with torch.no_grad():
        return served.model(x, graph.edge_index_dict(), **kwargs)


ZOO = "quiver_serve.models.typed_zoo"
CUSTOM = "tests.models.custom_typed"
TYPED_MODELS = {
    "to_hetero_sage_sum": ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                         "out_channels": 8}, {"aggr": "sum"}),
    "to_hetero_sage_mean": ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                          "out_channels": 8, "act_first": True}, {"aggr": "mean"}),
    # norms between layers that treat rows one by one (a layer computes only the rows the next
    # layer reads)
    "to_hetero_sage_batch_norm": ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                                "out_channels": 8, "norm": "batch_norm"},
                                  {"aggr": "sum"}),
    "to_hetero_sage_layer_norm": ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                                "out_channels": 8, "norm": "layer_norm",
                                                "norm_kwargs": {"mode": "node"}},
                                  {"aggr": "sum"}),
    "to_hetero_sage_max": ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                         "out_channels": 8}, {"aggr": "max"}),
    "to_hetero_gat_edges": ("GAT", {"hidden_channels": 8, "num_layers": 2, "out_channels": 4,
                                    "edge_dim": 3, "add_self_loops": False, "heads": 2},
                            {"aggr": "sum"}),
    "hetero_conv": (f"{ZOO}:HeteroSAGE", {"hidden_channels": 16, "out_channels": 8}, None),
    "rgcn": (f"{ZOO}:RGCN", {"hidden_channels": 16, "out_channels": 8, "num_bases": 2}, None),
    "hgt": (f"{ZOO}:HGT", {"hidden_channels": 16, "out_channels": 8, "heads": 2}, None),
    "custom_embedded": (f"{CUSTOM}:EmbeddedAuthors", {"num_embedded": 43, "embedded_type": "item",
                                                      "hidden_channels": 16,
                                                      "out_channels": 8}, None),
    "custom_edge_attr": (f"{CUSTOM}:EdgeAwareHetero", {"hidden_channels": 8, "out_channels": 4,
                                                       "edge_dim": 3}, None),
}


@pytest.mark.parametrize("name", list(TYPED_MODELS))
def test_exact_answers_equal_pyg_full_graph(name: str, tmp_path: Path) -> None:
    graph = shop_graph(seed=len(name))
    pyg_class, kwargs, to_hetero = TYPED_MODELS[name]
    served = build_typed_model(spec(pyg_class, kwargs, to_hetero), graph)
    # the weights load into the lazily sized model, and a rebuilt one answers the same
    path = tmp_path / "model.pt"
    torch.save(served.model.state_dict(), path)
    served = build_typed_model(spec(pyg_class, kwargs, to_hetero, weights=str(path)), graph)
    full = full_graph(served, graph)
    sampler = TypedReferenceSampler(graph)
    for node_type in ("user", "item"):
        ids = torch.tensor([0, 5, 5, graph.num_nodes[node_type] - 1])
        out = sampler.sample(node_type, ids, [-1, -1], seed=1)
        torch.testing.assert_close(served(out), full[node_type][ids], rtol=0, atol=TOL)
    if unsupported(served) is None:
        layerwise = TypedLayerwise(served)
        rows = layerwise.run(chunk_nodes=7)
        for node_type, want in full.items():
            torch.testing.assert_close(rows[node_type], want, rtol=0, atol=TOL)
        # trimmed per layer: the seeds' rows of the untrimmed forward, sampled or exact
        for fanouts in ([3, 2], [-1, -1]):
            out = sampler.sample("user", torch.tensor([2, 9, 2]), fanouts, seed=4)
            torch.testing.assert_close(layerwise.sampled(out), served(out), rtol=0, atol=TOL)
    else:
        assert name == "custom_edge_attr", unsupported(served)


def test_pyg_own_layers_when_the_fast_model_is_off() -> None:
    """``inference.fast_model: false``: every conv is PyG's (no direct SAGE, no SageSum), with
    the same answers."""
    graph = shop_graph(seed=6)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    served = build_typed_model(spec(pyg_class, kwargs, to_hetero), graph)
    fast, own = TypedLayerwise(served), TypedLayerwise(served, direct=False)
    assert all(f is None for layer in own.direct for f in layer.values()) and not own.use_groups
    assert any(f is not None for layer in fast.direct for f in layer.values())
    out = TypedReferenceSampler(graph).sample("user", torch.tensor([2, 9, 2]), [3, 2], seed=4)
    torch.testing.assert_close(own.sampled(out), fast.sampled(out), rtol=0, atol=TOL)


def test_a_graph_wide_norm_is_not_served_layer_by_layer() -> None:
    """A layer norm over all nodes of a graph makes every row depend on every node: no
    layer-wise (or trimmed) inference for it."""
    graph = shop_graph(seed=2)
    served = build_typed_model(spec("GraphSAGE", {"hidden_channels": 16, "num_layers": 2,
                                                  "out_channels": 8, "norm": "layer_norm"},
                                    {"aggr": "sum"}), graph)
    assert "norm over all nodes" in (unsupported(served) or "")


def test_sampled_answers_are_the_model_on_the_sample() -> None:
    graph = shop_graph(seed=4)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["hgt"]
    served = build_typed_model(spec(pyg_class, kwargs, to_hetero), graph)
    out = TypedReferenceSampler(graph).sample("user", torch.tensor([3, 1]), [2, 2], seed=9)
    rows = served(out)
    assert rows.shape == (2, 8) and served.out_dims["user"] == 8
    x = served.inputs(out.node)
    with torch.no_grad():
        want = served.model(x, out.edge_index)["user"][out.seed_index]
    torch.testing.assert_close(rows, want, rtol=0, atol=0)


@pytest.mark.parametrize("pyg_class,kwargs", [
    ("GAT", {"hidden_channels": 8, "num_layers": 2, "out_channels": 4, "heads": 2}),
    ("tests.models.custom_typed:GINE", {"hidden_channels": 8, "out_channels": 4}),
])
def test_homogeneous_models_read_edge_features(pyg_class: str, kwargs: dict) -> None:
    g = torch.Generator().manual_seed(2)
    data = HeteroData()
    data["node"].x = torch.randn(50, 5, generator=g)
    ei = torch.unique(torch.randint(0, 50, (2, 300), generator=g), dim=1)
    data["node", "to", "node"].edge_index = ei
    data["node", "to", "node"].edge_attr = torch.randn(ei.size(1), 4, generator=g)
    graph = TypedGraph.from_hetero_data(data, "edges")
    served = build_typed_model(spec(pyg_class, kwargs), graph)
    assert not served.typed and served.edge_attr_arg == "edge_attr"
    with torch.no_grad():
        full = served.model(data["node"].x, ei, edge_attr=data["node", "to", "node"].edge_attr)
        no_attr = torch.zeros_like(data["node", "to", "node"].edge_attr)
        ignoring = served.model(data["node"].x, ei, edge_attr=no_attr)
    assert not torch.allclose(full, ignoring), "the edge features change the answer"
    ids = torch.tensor([1, 7, 49])
    out = TypedReferenceSampler(graph).sample("node", ids, [-1, -1], seed=0)
    torch.testing.assert_close(served(out), full[ids], rtol=0, atol=TOL)


def test_metadata_mismatches_are_named(tmp_path: Path) -> None:
    graph = shop_graph(seed=1)
    zoo = f"{ZOO}:HeteroSAGE"
    metadata = (["user", "item", "shop", "brand"], [list(e) for e in graph.edge_types])
    with pytest.raises(ValueError, match="node type 'brand' is not in the graph"):
        build_typed_model(spec(zoo, {"hidden_channels": 4, "out_channels": 2,
                                     "metadata": metadata}), graph)
    short = (graph.node_types, [list(e) for e in graph.edge_types[1:]])
    with pytest.raises(ValueError, match=r"relation \['user', 'buys', 'item'\] is not in the "
                                         "model's metadata"):
        build_typed_model(spec(zoo, {"hidden_channels": 4, "out_channels": 2,
                                     "metadata": short}), graph)
    # weights trained on a graph with another relation name
    kwargs = {"hidden_channels": 4, "num_layers": 2, "out_channels": 2}
    served = build_typed_model(spec("GraphSAGE", kwargs, {"aggr": "sum"}), graph)
    state = {k.replace("user__knows__user", "user__likes__user"): v
             for k, v in served.model.state_dict().items()}
    torch.save(state, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"relation \['user', 'likes', 'user'\] that the graph "
                                         "does not have"):
        build_typed_model(spec("GraphSAGE", kwargs, {"aggr": "sum"},
                               weights=str(tmp_path / "other.pt")), graph)
    with pytest.raises(ValueError, match="set model.to_hetero"):
        build_typed_model(spec("GraphSAGE", kwargs), graph)


def test_typed_model_from_the_repository(tmp_path: Path) -> None:
    import yaml

    from quiver_serve.models.repository import ModelRepository, RepositoryError

    graph = shop_graph(seed=6)
    kwargs = {"hidden_channels": 8, "num_layers": 2, "out_channels": 4}
    first = build_typed_model(spec("GraphSAGE", kwargs, {"aggr": "mean"}), graph)
    folder = tmp_path / "shop"
    (folder / "1").mkdir(parents=True)
    torch.save(first.model.state_dict(), folder / "1" / "model.pt")
    config = {"class": "GraphSAGE", "kwargs": kwargs, "to_hetero": {"aggr": "mean"},
              "featureless_value": 0.5}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (loaded,), _ = ModelRepository(tmp_path).specs("shop")
    assert loaded.to_hetero == {"aggr": "mean"} and loaded.featureless_value == 0.5
    served = build_typed_model(loaded, graph)
    assert torch.equal(served.inputs({"item": torch.tensor([3])})["item"], torch.tensor([[0.5]]))
    out = TypedReferenceSampler(graph).sample("item", torch.tensor([1, 2]), [-1, -1], seed=0)
    x = {t: graph.x[t] if t in graph.x else torch.full((n, 1), 0.5)
         for t, n in graph.num_nodes.items()}
    with torch.no_grad():
        want = served.model(x, graph.edge_index_dict())["item"][torch.tensor([1, 2])]
    torch.testing.assert_close(served(out), want, rtol=0, atol=TOL)
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "to_hetero": {"aggr": "avg"}}))
    with pytest.raises(RepositoryError, match="shop/config.yaml: to_hetero.aggr must be one of"):
        ModelRepository(tmp_path).specs("shop")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["to_hetero_sage_sum", "to_hetero_gat_edges", "hgt",
                                  "custom_embedded"])
def test_on_the_gpu_the_answers_are_the_cpus(name: str) -> None:
    graph = shop_graph(seed=2)
    pyg_class, kwargs, to_hetero = TYPED_MODELS[name]
    served = build_typed_model(spec(pyg_class, kwargs, to_hetero), graph)
    layerwise = TypedLayerwise(served)
    cpu_rows = layerwise.run(chunk_nodes=16)
    seeds = torch.tensor([4, 0, 4])
    out = TypedReferenceSampler(graph).sample("user", seeds, [3, 2], seed=2)
    cpu_sampled = layerwise.sampled(out)
    served.to("cuda")
    gpu_rows = layerwise.run(chunk_nodes=16)
    for t, want in cpu_rows.items():
        torch.testing.assert_close(gpu_rows[t].cpu(), want, rtol=1e-4, atol=1e-4)
    gpu_out = TypedReferenceSampler(graph.to("cuda")).sample("user", seeds, [3, 2], seed=2)
    torch.testing.assert_close(layerwise.sampled(gpu_out).cpu(), cpu_sampled, rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(served(gpu_out).cpu(), cpu_sampled, rtol=1e-4, atol=1e-4)


def test_weights_that_are_not_a_state_dict_are_named(tmp_path: Path) -> None:
    graph = shop_graph(seed=3)
    kwargs = {"hidden_channels": 4, "num_layers": 2, "out_channels": 2}
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="bad.pt cannot be loaded weights-only"):
        build_typed_model(spec("GraphSAGE", kwargs, {"aggr": "sum"},
                               weights=str(tmp_path / "bad.pt")), graph)
    with pytest.raises(FileNotFoundError, match="missing.pt do not exist"):
        build_typed_model(spec("GraphSAGE", kwargs, {"aggr": "sum"},
                               weights=str(tmp_path / "missing.pt")), graph)
