"""Config: the default loads, errors name the file and the field, docs/config.md stays in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiver_serve.config import REPO_ROOT, ConfigError, ServeConfig, reference_markdown


def test_default_config_is_the_embedded_cora_graphsage() -> None:
    cfg = ServeConfig.default()
    assert cfg.graph.format == "planetoid" and cfg.model.pyg_class == "GraphSAGE"
    assert cfg.server.host == "127.0.0.1"
    assert (REPO_ROOT / cfg.model.weights).exists()


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
    from quiver_serve.config import DEFAULT_CONFIG_PATH

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
