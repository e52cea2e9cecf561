"""Config: the default loads, errors name the file and the field, docs/config.md stays in sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quiver_serve.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULTS_DIR,
    ConfigError,
    GraphConfig,
    ServeConfig,
    reference_markdown,
    resolve_path,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_default_config_is_the_embedded_cora_graphsage() -> None:
    cfg = ServeConfig.default()
    assert cfg.graph.format == "planetoid" and cfg.model.pyg_class == "GraphSAGE"
    assert cfg.server.host == "127.0.0.1"
    # package data, found through the package (not the working directory or a checkout)
    assert DEFAULT_CONFIG_PATH.parent == DEFAULTS_DIR
    for path in (cfg.model.weights, cfg.graph.path):
        assert Path(path).is_absolute() and Path(path).is_relative_to(DEFAULTS_DIR), path
        assert Path(path).exists(), path
    assert (DEFAULTS_DIR / "planetoid" / "LICENSE.kimiyoung-planetoid").exists()  # the data's licence


def test_relative_paths_are_taken_from_the_config_files_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "serve.yaml").write_text(
        "graph:\n  format: npz\n  path: data/g.npz\n  update_log_dir: ../state\n"
        "model:\n  weights: ~/w.pt\nmodels:\n  repository: /srv/repo\n")
    monkeypatch.chdir(tmp_path)  # not the file's folder
    cfg = ServeConfig.from_yaml("etc/serve.yaml")
    assert cfg.graph.path == str(folder / "data" / "g.npz")
    assert cfg.graph.update_log_dir == str(tmp_path / "state")  # normalised, no ".."
    assert cfg.model.weights == str(Path("~/w.pt").expanduser())
    assert cfg.models.repository == "/srv/repo"
    # dumped anywhere, the config names the same files (tests write configs to tmp folders)
    other = tmp_path / "elsewhere" / "copy.yaml"
    other.parent.mkdir()
    other.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert ServeConfig.from_yaml(other) == cfg


def test_unset_paths_are_the_packages_and_overrides_the_working_directorys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    only_port = tmp_path / "port.yaml"
    only_port.write_text("server:\n  port: 8123\n")
    cfg = ServeConfig.from_yaml(only_port)  # no graph: or model: section
    assert cfg.graph.path == ServeConfig.default().graph.path
    assert cfg.model.weights == ServeConfig.default().model.weights
    assert GraphConfig().path == str(DEFAULTS_DIR / "planetoid" / "cora" / "raw")
    monkeypatch.chdir(tmp_path)
    env = {"QUIVER_SERVE__GRAPH__PATH": "mine/cora", "QUIVER_SERVE__MODEL__WEIGHTS": "null"}
    loaded = ServeConfig.load(only_port, environ=env)
    assert loaded.graph.path == str(tmp_path / "mine" / "cora") and loaded.model.weights is None
    assert cfg.with_overrides(["graph.path=g.npz"]).graph.path == str(tmp_path / "g.npz")
    assert resolve_path("x/y") == tmp_path / "x" / "y"
    assert resolve_path("/abs/y") == Path("/abs/y")


@pytest.mark.parametrize("text,needle", [
    ("sampling:\n  fanouts: [25, 0]\n", "fanouts"),
    ("sampling:\n  fanouts: [5]\n", "num_layers"),
    ("server:\n  port: 70000\n", "server.port"),
    ("model:\n  pyg_clas: GCN\n", "model.pyg_clas"),
    ("batching: 3\n", "batching"),
    ("sampling:\n  route: cpu\n  num_cpu_workers: 0\n", "num_cpu_workers"),
    ("[1, 2]\n", "mapping"),
    ("a: [\n", "YAML"),
])
def test_errors_name_file_and_field(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        ServeConfig.from_yaml(path)
    assert str(path) in str(exc.value) and needle in str(exc.value)


def test_every_shipped_config_validates() -> None:
    for path in (REPO_ROOT / "configs").glob("*.yaml"):
        ServeConfig.from_yaml(path)


def test_config_reference_is_current() -> None:
    reference = (REPO_ROOT / "docs" / "config.md").read_text()
    assert reference_markdown() in reference, \
        "docs/config.md's table is not the models' own: run python -m bench.update_config_reference"


def test_environment_overrides_single_fields_and_names_bad_ones(tmp_path: Path) -> None:
    env = {"QUIVER_SERVE__SERVER__PORT": "9001", "QUIVER_SERVE__SAMPLING__FANOUTS": "[5, 5]",
           "QUIVER_SERVE__SERVER__HOST": "0.0.0.0", "QUIVER_SERVE_TOKEN": "not a field override"}
    cfg = ServeConfig.load(environ=env)
    assert (cfg.server.port, cfg.sampling.fanouts, cfg.server.host) == (9001, [5, 5], "0.0.0.0")
    other = tmp_path / "other.yaml"
    other.write_text(DEFAULT_CONFIG_PATH.read_text().replace("port: 8000", "port: 8123"))
    assert ServeConfig.load(environ={"QUIVER_SERVE_CONFIG": str(other)}).server.port == 8123
    assert ServeConfig.load(str(other), environ={"QUIVER_SERVE__SERVER__PORT": "1"}).server.port == 1
    with pytest.raises(ConfigError, match="QUIVER_SERVE__SERVER__PROT"):
        ServeConfig.load(environ={"QUIVER_SERVE__SERVER__PROT": "1"})
    with pytest.raises(ConfigError, match="server.port"):
        ServeConfig.load(environ={"QUIVER_SERVE__SERVER__PORT": "eighty"})
    with pytest.raises(ConfigError, match="sampling.fanouts"):  # validators still run
        ServeConfig.load(environ={"QUIVER_SERVE__SAMPLING__FANOUTS": "[5]"})


def test_exact_materialize_takes_bare_yaml_on_and_off(tmp_path) -> None:
    """YAML reads ``on`` / ``off`` as booleans: the file, ``--set`` and the environment all
    still mean the words."""
    for word in ("on", "off", "auto"):
        path = tmp_path / f"{word}.yaml"
        path.write_text(f"exact:\n  materialize: {word}\n")
        assert ServeConfig.from_yaml(path).exact.materialize == word
        assert ServeConfig.default().with_overrides([f"exact.materialize={word}"]) \
            .exact.materialize == word
        env = {"QUIVER_SERVE__EXACT__MATERIALIZE": word}
        assert ServeConfig.load(environ=env).exact.materialize == word
