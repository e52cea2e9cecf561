"""Any PyG model: classes of torch_geometric.nn.models by name, the operator's own modules by
import path (from the package or from the model's folder), weights errors, and exact mode of
models that are not PyG's BasicGNN."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.classes import import_model_module
from quiver_serve.models.served import ServedModel, build_model, model_metadata, probe_out_dim
from quiver_serve.models.spec import ModelSpec
from quiver_serve.sampling.reference import ReferenceSampler
from tests.models import custom_gnn

CUSTOM = Path(custom_gnn.__file__)
SEEDS = torch.tensor([0, 5, 5, 2707, 1200, 633])


def spec_of(pyg_class: str, kwargs: dict, **fields: object) -> ModelSpec:
    return ModelSpec("m", 1, pyg_class, kwargs, **fields)  # type: ignore[arg-type]


def model_folder(tmp_path: Path, source: str | None = None) -> Path:
    """A model's repository folder holding a copy of custom_gnn.py (or ``source`` as it)."""
    folder = tmp_path / "gin"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "custom_gnn.py"
    if source is None:
        shutil.copy(CUSTOM, target)
    else:
        target.write_text(source)
    return folder


def exact_rows(served: ServedModel, graph: GraphData, layers: int) -> torch.Tensor:
    """Seed rows of an exact-mode forward over the full ``layers``-hop subgraph."""
    out = ReferenceSampler(graph.indptr, graph.indices).sample(SEEDS, [-1] * layers, seed=0)
    emb = served(graph.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                 out.num_sampled_edges, exact=True)
    return emb[out.seed_index]


# ---- classes -----------------------------------------------------------------------------------
def test_import_path_from_the_package() -> None:
    model = build_model(spec_of("tests.models.custom_gnn:WeightedGIN",
                                {"hidden_channels": 8, "out_channels": 4}), 10)
    assert type(model) is custom_gnn.WeightedGIN and not model.training


def test_import_path_from_the_model_folder(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    path_before = list(sys.path)
    model = build_model(spec_of("custom_gnn:PlainGIN", {"hidden_channels": 8, "embedding_dim": 3},
                                module_dir=str(folder)), 10)
    assert sys.path == path_before
    assert type(model).__name__ == "PlainGIN" and type(model) is not custom_gnn.PlainGIN
    module_file = sys.modules[type(model).__module__].__file__
    assert module_file is not None and Path(module_file).parent == folder
    # the same file again: the same module; another folder or an edited file: imported afresh
    assert import_model_module("custom_gnn", str(folder)) is sys.modules[type(model).__module__]
    other = model_folder(tmp_path / "other")
    assert import_model_module("custom_gnn", str(other)) is not \
        import_model_module("custom_gnn", str(folder))
    before = import_model_module("custom_gnn", str(folder))
    (folder / "custom_gnn.py").write_text(CUSTOM.read_text() + "\nEDITED = True\n")
    after = import_model_module("custom_gnn", str(folder))
    assert after is not before and after.EDITED and not hasattr(before, "EDITED")


def test_a_package_in_the_model_folder_with_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "gin" / "mygnn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(CUSTOM, package / "layers.py")
    (package / "model.py").write_text("from .layers import WeightedGIN as Model\n")
    model = build_model(spec_of("mygnn.model:Model", {"hidden_channels": 8, "out_channels": 4},
                                module_dir=str(tmp_path / "gin")), 10)
    assert type(model).__name__ == "WeightedGIN"


def test_a_module_not_in_the_folder_comes_from_the_import_system(tmp_path: Path) -> None:
    model = build_model(spec_of("tests.models.custom_gnn:WeightedGIN",
                                {"hidden_channels": 8, "out_channels": 4},
                                module_dir=str(model_folder(tmp_path))), 10)
    assert type(model) is custom_gnn.WeightedGIN


def test_pyg_classes_by_name_and_unknown_names() -> None:
    model = build_model(spec_of("GIN", {"hidden_channels": 8, "num_layers": 2,
                                        "out_channels": 4}), 10)
    from torch_geometric.nn.models import GIN
    assert isinstance(model, GIN)
    with pytest.raises(ValueError, match="GraphSAGE") as info:
        build_model(spec_of("GraphSage", {}), 10)
    assert "'GraphSage' is not in torch_geometric.nn.models" in str(info.value)
    with pytest.raises(ValueError, match="not in torch_geometric"):
        build_model(spec_of("basic_gnn", {}), 10)  # a module of that package, not a class


def test_in_channels_only_for_classes_that_take_it(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "import torch\n\nclass Width(torch.nn.Module):\n"
                                    "    def __init__(self, width):\n"
                                    "        super().__init__()\n"
                                    "        self.lin = torch.nn.Linear(10, width)\n\n"
                                    "    def forward(self, x, edge_index):\n"
                                    "        return self.lin(x)\n")
    spec = spec_of("custom_gnn:Width", {"width": 6}, module_dir=str(folder))
    assert build_model(spec, 10).lin.out_features == 6
    assert model_metadata(spec, 10)["pyg_model"]["kwargs"] == {"width": 6}
    assert model_metadata(spec_of("GIN", {"num_layers": 2}), 10)["pyg_model"]["kwargs"] == \
        {"num_layers": 2, "in_channels": 10}
    with pytest.raises(ValueError, match="in_channels=3 but the graph has 10"):
        build_model(spec_of("tests.models.custom_gnn:WeightedGIN",
                            {"in_channels": 3, "hidden_channels": 8, "out_channels": 4}), 10)


@pytest.mark.parametrize(("pyg_class", "kwargs", "match"), [
    ("tests.models.no_such_module:Model", {}, "cannot import 'tests.models.no_such_module:Model'"),
    ("tests.models.custom_gnn:Missing", {}, "has no attribute 'Missing'"),
    ("tests.models.custom_gnn:NotAModel", {}, "is not a torch.nn.Module subclass"),
    ("tests.models.custom_gnn:WeightedGIN", {"hidden": 8}, r"WeightedGIN\(\*\*.*\) failed"),
    ("tests/models/custom_gnn.py:WeightedGIN", {}, "is not an import path"),
])
def test_class_errors_name_the_class(pyg_class: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(spec_of(pyg_class, kwargs), 10)


def test_a_module_failing_on_import_names_the_cause(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "import torch\nraise RuntimeError('licence server down')\n")
    with pytest.raises(ValueError, match="cannot import 'custom_gnn:X'.*licence server down"):
        build_model(spec_of("custom_gnn:X", {}, module_dir=str(folder)), 10)
    folder = model_folder(tmp_path, "def broken(:\n")
    with pytest.raises(ValueError, match="cannot import 'custom_gnn:X'.*SyntaxError"):
        build_model(spec_of("custom_gnn:X", {}, module_dir=str(folder)), 10)


# ---- weights -----------------------------------------------------------------------------------
GIN_KWARGS = {"hidden_channels": 8, "out_channels": 4, "num_layers": 2}


def saved(tmp_path: Path, state: object, name: str = "model.pt") -> ModelSpec:
    path = tmp_path / name
    torch.save(state, path)
    return spec_of("tests.models.custom_gnn:WeightedGIN", GIN_KWARGS, weights=str(path))


def test_weights_load_exactly(tmp_path: Path) -> None:
    model = custom_gnn.WeightedGIN(10, **GIN_KWARGS)
    loaded = build_model(saved(tmp_path, model.state_dict()), 10)
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_weights_errors_name_the_file_and_the_fault(tmp_path: Path) -> None:
    good = custom_gnn.WeightedGIN(10, **GIN_KWARGS).state_dict()
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        build_model(spec_of("GIN", {"hidden_channels": 8, "num_layers": 2},
                            weights=str(tmp_path / "nope.pt")), 10)
    shape = custom_gnn.WeightedGIN(10, 16, 4).state_dict()
    with pytest.raises(ValueError, match=r"shape\.pt does not match .*size mismatch"):
        build_model(saved(tmp_path, shape, "shape.pt"), 10)
    nan = {**good, "layers.1.mlp.2.bias": torch.tensor([0.0, float("nan"), 0.0, 0.0])}
    with pytest.raises(ValueError, match=r"nan\.pt: tensor 'layers.1.mlp.2.bias' holds NaN") \
            as info:
        build_model(saved(tmp_path, nan, "nan.pt"), 10)
    assert str(tmp_path) not in str(info.value)  # named by label or file name only
    labelled = ModelSpec(**{**saved(tmp_path, nan, "nan.pt").to_dict(),
                            "weights_label": "gin/2/model.pt"})
    with pytest.raises(ValueError, match=r"^gin/2/model\.pt: tensor 'layers.1.mlp.2.bias'"):
        build_model(labelled, 10)
    inf = {**good, "layers.0.eps": torch.tensor([float("inf")])}
    with pytest.raises(ValueError, match=r"tensor 'layers.0.eps' holds NaN or infinite"):
        build_model(saved(tmp_path, inf, "inf.pt"), 10)
    missing = {k: v for k, v in good.items() if k != "layers.0.eps"}
    with pytest.raises(ValueError, match=r"missing keys \['layers.0.eps'\]"):
        build_model(saved(tmp_path, missing, "missing.pt"), 10)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        build_model(saved(tmp_path, {**good, "extra": torch.zeros(1)}, "extra.pt"), 10)
    with pytest.raises(ValueError, match=r"list\.pt is not a state_dict: it holds a list"):
        build_model(saved(tmp_path, list(good.values()), "list.pt"), 10)
    with pytest.raises(ValueError, match=r"key 'epoch' holds a int"):
        build_model(saved(tmp_path, {"epoch": 3, "state_dict": good}, "ckpt.pt"), 10)
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"garbage\.pt cannot be loaded weights-only"):
        build_model(spec_of("tests.models.custom_gnn:WeightedGIN", GIN_KWARGS,
                            weights=str(tmp_path / "garbage.pt")), 10)


def test_metadata_of_a_spec_names_its_label_never_the_server_path(tmp_path: Path) -> None:
    spec = saved(tmp_path, custom_gnn.WeightedGIN(10, **GIN_KWARGS).state_dict())
    assert model_metadata(spec, 10)["state_dict"] == "model.pt"  # outside the checkout: name
    labelled = ModelSpec(**{**spec.to_dict(), "weights_label": "gin/3/model.pt"})
    assert model_metadata(labelled, 10) == {
        "pyg_model": {"class": "tests.models.custom_gnn:WeightedGIN",
                      "kwargs": {**GIN_KWARGS, "in_channels": 10}},
        "state_dict": "gin/3/model.pt"}
    escaping = ModelSpec(**{**spec.to_dict(), "weights_label": "../../etc/model.pt"})
    assert model_metadata(escaping, 10)["state_dict"] == "model.pt"


# ---- serving -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["WeightedGIN", "PlainGIN"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_custom_model_exact_mode_equals_full_graph(cora: GraphData, cls: str, layers: int) -> None:
    """Over the full L-hop subgraph the seed rows of ``model(x, edge_index)`` are exact."""
    torch.manual_seed(layers)
    model = getattr(custom_gnn, cls)(cora.num_features, 16, 8, num_layers=layers).eval()
    served = ServedModel(model, cora.degree(), cora.self_loop_count(),
                         in_channels=cora.num_features)
    assert served.fast is None and not served.trims and served.out_dim == 8
    with torch.no_grad():
        full = model(cora.x, cora.edge_index())[SEEDS]
    torch.testing.assert_close(exact_rows(served, cora, layers), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_pyg_gin_by_name_exact_mode_equals_full_graph(cora: GraphData, layers: int) -> None:
    model = build_model(spec_of("GIN", {"hidden_channels": 16, "num_layers": layers,
                                        "out_channels": 8}, random_init_seed=layers),
                        cora.num_features)
    served = ServedModel(model, cora.degree(), cora.self_loop_count())
    assert served.trims and served.fast is None and served.out_dim == 8  # GINConv: no fast twin
    with torch.no_grad():
        full = model(cora.x, cora.edge_index())[SEEDS]
    torch.testing.assert_close(exact_rows(served, cora, layers), full, atol=1e-5, rtol=1e-5)


def test_custom_model_in_sampled_mode(cora: GraphData) -> None:
    model = custom_gnn.WeightedGIN(cora.num_features, 16, 8).eval()
    served = ServedModel(model, in_channels=cora.num_features)
    out = ReferenceSampler(cora.indptr, cora.indices).sample(SEEDS, [5, 3], seed=1)
    emb = served(cora.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                 out.num_sampled_edges, exact=False)
    with torch.no_grad():
        want = model(cora.x[out.n_id], out.edge_index)
    torch.testing.assert_close(emb, want)


def test_out_dim_of_custom_models() -> None:
    plain = custom_gnn.PlainGIN(10, 8, 5).eval()
    assert probe_out_dim(plain, 10) == 5
    assert ServedModel(plain, in_channels=10).out_dim == 5
    with pytest.raises(ValueError, match="pass in_channels"):
        ServedModel(plain)  # neither in_channels nor out_channels known
    assert ServedModel(custom_gnn.WeightedGIN(10, 8, 6).eval()).out_dim == 6  # its attribute

    class Pooled(nn.Module):
        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            return x.sum(0)

    with pytest.raises(ValueError, match=r"one row per node \[num_nodes, dim\], got \(10,\)"):
        ServedModel(Pooled(), in_channels=10)
    with pytest.raises(ValueError, match="failed on a probe graph"):
        ServedModel(custom_gnn.PlainGIN(7, 8, 5).eval(), in_channels=10)


def test_release_frees_every_tensor(cora: GraphData) -> None:
    model = build_model(spec_of("GCN", {"hidden_channels": 8, "num_layers": 2,
                                        "out_channels": 4}), cora.num_features)
    served = ServedModel(model, cora.degree(), cora.self_loop_count())
    assert served.fast is not None and served.gcn_norm is not None
    layers = served.fast.layers
    served.release()
    assert served.fast is None and served.gcn_norm is None and served.gcn_convs == []
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(not isinstance(v, torch.Tensor) for layer in layers for v in vars(layer).values())
    out = ReferenceSampler(cora.indptr, cora.indices).sample(SEEDS, [5, 3], seed=1)
    with pytest.raises(RuntimeError, match="released"):
        served(cora.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
               out.num_sampled_edges, exact=False)
    served.release()  # twice: a no-op
