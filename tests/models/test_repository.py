"""The model repository reader: layout, config.yaml checks, version policies, traffic, names."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from quiver_serve.models.repository import (
    ModelDefinition,
    ModelRepository,
    RepositoryError,
    VersionPolicy,
)
from quiver_serve.models.served import ServedModel, build_model
from tests.models import custom_gnn

SAGE = {"class": "GraphSAGE", "kwargs": {"hidden_channels": 8, "num_layers": 2, "out_channels": 4}}


def add_model(root: Path, name: str, config: dict[str, Any] | str, versions: list[int | str] = (),
              weights: bool = True) -> Path:
    """``root/name`` with its config.yaml and version folders (``model.pt`` a placeholder: the
    reader never loads it)."""
    folder = root / name
    folder.mkdir(parents=True)
    text = config if isinstance(config, str) else yaml.safe_dump(config)
    (folder / "config.yaml").write_text(text)
    for v in versions:
        (folder / str(v)).mkdir()
        if weights:
            (folder / str(v) / "model.pt").write_bytes(b"weights")
    return folder


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    add_model(tmp_path, "sage", SAGE, [1, 2, 10])
    return ModelRepository(tmp_path)


def with_config(repo: ModelRepository, **changes: Any) -> ModelRepository:
    config = {**SAGE, **changes}
    (repo.root / "sage" / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


# ---- layout ------------------------------------------------------------------------------------
def test_names_versions_and_index(tmp_path: Path) -> None:
    add_model(tmp_path, "sage", SAGE, [2, 10, 1, "01", "0", "abc", "__pycache__"])
    add_model(tmp_path, "gcn-v2.b", SAGE)
    (tmp_path / "no_config").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "config.yaml").write_text("class: GCN\n")
    (tmp_path / "README.md").write_text("models")
    (tmp_path / "sage" / "3").write_text("a file, not a version folder")
    repo = ModelRepository(tmp_path)
    assert repo.names() == ["gcn-v2.b", "sage"]
    assert repo.versions("sage") == [1, 2, 10]
    assert repo.versions("gcn-v2.b") == []
    assert repo.index() == [{"name": "gcn-v2.b", "version": None},
                            {"name": "sage", "version": 1}, {"name": "sage", "version": 2},
                            {"name": "sage", "version": 10}]


def test_specs_of_the_served_versions(repo: ModelRepository) -> None:
    with_config(repo, fanouts=[5, 3], random_init_seed=7, version_policy={"all": True})
    specs, traffic = repo.specs("sage")
    assert [s.version for s in specs] == [1, 2, 10]
    spec = specs[-1]
    assert (spec.name, spec.pyg_class, spec.num_layers, spec.fanouts) == ("sage", "GraphSAGE", 2,
                                                                          [5, 3])
    assert spec.kwargs == SAGE["kwargs"] and spec.random_init_seed == 7
    assert spec.weights == str(repo.root / "sage" / "10" / "model.pt")
    assert Path(spec.weights).is_absolute()
    assert spec.module_dir == str(repo.root / "sage")
    assert spec.weights_label == "sage/10/model.pt"
    assert traffic == {1: 0.0, 2: 0.0, 10: 1.0}  # default: all to the newest served version
    assert type(spec).from_dict(spec.to_dict()) == spec


def test_repository_model_is_built_and_served(tmp_path: Path) -> None:
    """A custom class from the model's folder, its weights in version 1: what the engine does."""
    folder = add_model(tmp_path, "gin", {"class": "custom_gnn:WeightedGIN",
                                         "kwargs": {"hidden_channels": 8, "out_channels": 4},
                                         "num_layers": 2}, [1], weights=False)
    shutil.copy(custom_gnn.__file__, folder / "custom_gnn.py")
    trained = custom_gnn.WeightedGIN(10, 8, 4)
    torch.save(trained.state_dict(), folder / "1" / "model.pt")
    repo = ModelRepository(tmp_path)
    assert repo.versions("gin") == [1]  # __pycache__ or the module never count as versions
    (spec,), _ = repo.specs("gin")
    served = ServedModel(build_model(spec, 10), in_channels=10)
    x, edge_index = torch.randn(5, 10), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(served.model(x, edge_index), trained(x, edge_index))
    assert served.out_dim == 4
    assert repo.versions("gin") == [1]


# ---- version policies and traffic --------------------------------------------------------------
@pytest.mark.parametrize(("policy", "served"), [
    (None, [10]), ({"latest": 1}, [10]), ({"latest": 2}, [2, 10]), ({"latest": 9}, [1, 2, 10]),
    ({"specific": [10, 1]}, [1, 10]), ({"all": True}, [1, 2, 10]),
])
def test_version_policies(repo: ModelRepository, policy: dict | None, served: list[int]) -> None:
    if policy is not None:
        with_config(repo, version_policy=policy)
    definition = repo.definition("sage")
    assert repo.served_versions("sage", definition) == served
    assert [s.version for s in repo.specs("sage")[0]] == served


def test_traffic_is_normalised_over_served_versions(repo: ModelRepository) -> None:
    with_config(repo, version_policy={"latest": 2}, traffic={2: 3, 10: 1})
    assert repo.specs("sage")[1] == {2: 0.75, 10: 0.25}
    with_config(repo, version_policy={"all": True}, traffic={10: 0.5})
    assert repo.specs("sage")[1] == {1: 0.0, 2: 0.0, 10: 1.0}


def test_overrides_set_policy_and_traffic_only(repo: ModelRepository) -> None:
    specs, traffic = repo.specs("sage", {"version_policy": {"specific": [1, 2]},
                                         "traffic": {"1": 0.9, "2": 0.1}})  # JSON: string keys
    assert [s.version for s in specs] == [1, 2]
    assert traffic == pytest.approx({1: 0.9, 2: 0.1})
    for key, value in [("class", "os:system"), ("kwargs", {"out_channels": 9}),
                       ("fanouts", [1, 1])]:
        with pytest.raises(RepositoryError, match=r"a load may set only \['version_policy', "
                           r"'traffic'\], not \['" + key + r"'\]: import paths and model "
                           "definitions come only from the repository's files"):
            repo.specs("sage", {key: value})


# ---- errors ------------------------------------------------------------------------------------
CONFIG_ERRORS = [
    ("class: [GCN\n", "cannot be read as YAML"),
    ("- class: GCN\n", "must be a mapping"),
    ({**SAGE, "klass": "GCN", "weights": "x"}, r"unknown keys \['klass', 'weights'\]"),
    ({"kwargs": SAGE["kwargs"]}, "'class' is required"),
    ({**SAGE, "class": "os.system"}, "class must be a class of torch_geometric.nn.models"),
    ({**SAGE, "kwargs": [1, 2]}, "kwargs must be a mapping"),
    ({"class": "pkg.mod:Model", "kwargs": {}}, "num_layers is required"),
    ({**SAGE, "num_layers": 3}, "num_layers is 3 but kwargs.num_layers is 2"),
    ({**SAGE, "num_layers": 0}, "num_layers must be a positive integer"),
    ({**SAGE, "fanouts": [25, 10, 5]}, "fanouts has 3 hops but num_layers is 2"),
    ({**SAGE, "fanouts": [25, 0]}, "fanouts must be a list of integers >= 1 or -1"),
    ({**SAGE, "version_policy": {"latest": 1, "all": True}}, "exactly one of"),
    ({**SAGE, "version_policy": {"newest": 1}}, "version_policy 'newest' is unknown"),
    ({**SAGE, "version_policy": {"latest": 0}}, "version_policy.latest must be a positive"),
    ({**SAGE, "version_policy": {"all": False}}, "version_policy.all must be true"),
    ({**SAGE, "version_policy": {"specific": []}}, "specific must be a non-empty list"),
    ({**SAGE, "traffic": {1: -0.5}}, "traffic weight of version 1 must be a finite number >= 0"),
    ({**SAGE, "traffic": {1: 0, 2: 0}}, "traffic weights must sum above 0"),
    ({**SAGE, "traffic": {"one": 1}}, "traffic key must be a positive integer"),
    ({**SAGE, "random_init_seed": "seven"}, "random_init_seed must be an integer"),
]


@pytest.mark.parametrize(("config", "match"), CONFIG_ERRORS)
def test_config_errors_name_the_file(tmp_path: Path, config: dict | str, match: str) -> None:
    add_model(tmp_path, "bad", config, [1, 2])
    with pytest.raises(RepositoryError, match=match) as info:
        ModelRepository(tmp_path).specs("bad")
    assert str(info.value).startswith("bad/config.yaml")  # relative: no server directories
    assert str(tmp_path) not in str(info.value)


def test_serving_errors_name_the_versions(repo: ModelRepository) -> None:
    with_config(repo, version_policy={"specific": [2, 3, 4]})
    with pytest.raises(RepositoryError, match=r"specific names versions \[3, 4\] that have no "
                                              r"folder \(on disk: \[1, 2, 10\]\)"):
        repo.specs("sage")
    with_config(repo, version_policy={"latest": 1}, traffic={2: 1.0, 10: 1.0})
    with pytest.raises(RepositoryError, match=r"traffic names versions \[2\] that are not served "
                                              r"\(served: \[10\]\)"):
        repo.specs("sage")
    with_config(repo)
    (repo.root / "sage" / "10" / "model.pt").unlink()
    with pytest.raises(RepositoryError, match=r"version 10: sage/10/model\.pt does not exist"):
        repo.specs("sage")
    add_model(repo.root, "empty", SAGE)
    with pytest.raises(RepositoryError, match="no version to serve"):
        repo.specs("empty")
    with pytest.raises(RepositoryError, match=r"'missing': missing/config\.yaml does not exist"):
        repo.specs("missing")


@pytest.mark.parametrize("name", ["../sage", "..", ".", ".hidden", "a/b", "", "sage/../sage",
                                  "/etc", "sa ge", "sage\x00"])
def test_names_cannot_escape_the_repository(repo: ModelRepository, name: str) -> None:
    with pytest.raises(RepositoryError, match="is not valid"):
        repo.specs(name)
    with pytest.raises(RepositoryError, match="is not valid"):
        repo.versions(name)


def test_a_model_folder_linked_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    add_model(outside, "secret", SAGE, [1])
    root = tmp_path / "repo"
    add_model(root, "sage", SAGE, [1])
    (root / "linked").symlink_to(outside / "secret")
    (root / "inside").symlink_to(root / "sage")
    repo = ModelRepository(root)
    assert repo.names() == ["inside", "sage"]
    with pytest.raises(RepositoryError, match="resolves outside"):
        repo.specs("linked")
    assert repo.specs("inside")[0][0].weights_label == "inside/1/model.pt"


def test_a_missing_repository_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="is not a folder"):
        ModelRepository(tmp_path / "nope")


def test_definitions_parse_directly() -> None:
    definition = ModelDefinition.from_dict({**SAGE, "traffic": {1: 1, 2: 3}})
    assert definition.num_layers == 2 and definition.fanouts is None
    assert definition.policy == VersionPolicy("latest", latest=1)
    assert definition.traffic == {1: 1.0, 2: 3.0}
    assert VersionPolicy.parse({"specific": [3, 1, 3]}, "x").to_dict() == {"specific": [1, 3]}
    assert ModelDefinition.from_dict({"class": "pkg.mod:Model", "num_layers": 3}).kwargs == {}
