"""The model repository: the operator's folder of models and versions, read into :class:`ModelSpec`.

Layout (``models.repository``)::

    repo/
      sage/                 a model, named by its folder ([A-Za-z0-9_.-]+, not starting with '.')
        config.yaml         what to build: class, kwargs, depth, fanouts, versions, traffic
        custom_gnn.py       optional: a module the class may come from ("custom_gnn:MyGNN")
        1/model.pt          version 1: a weights-only state_dict
        2/model.pt

``config.yaml``::

    class: GraphSAGE                 # a class of torch_geometric.nn.models, or "module:Class"
    kwargs: {hidden_channels: 256, num_layers: 2, out_channels: 64}   # in_channels from the graph
    num_layers: 2                    # optional when kwargs has num_layers
    fanouts: [25, 10]                # optional (default: sampling.fanouts); one per layer
    version_policy: {latest: 1}      # or {specific: [1, 3]} or {all: true}
    traffic: {1: 0.9, 2: 0.1}        # optional; default: all to the newest served version
    random_init_seed: 0              # optional
    to_hetero: {aggr: sum}           # optional, typed graphs: PyG's to_hetero(class, metadata)
    featureless_value: 1.0           # optional, typed graphs: the column of featureless types

What to build and which code to import come only from these files: a load call may change the
version policy and the traffic split (``overrides``), nothing else. Model names reach the reader
from URLs, so a name is checked against the pattern above and its folder must resolve inside the
repository.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from quiver_serve.config import TO_HETERO_AGGRS
from quiver_serve.models.spec import IMPORT_PATH, ModelSpec

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
VERSION_PATTERN = re.compile(r"[1-9][0-9]*")
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.pt"
#: what a load call may change; everything else comes from the repository's files
OVERRIDE_KEYS = ("version_policy", "traffic")
_CLASS_NAME = re.compile(r"[A-Za-z_]\w*")


class RepositoryError(ValueError):
    """The repository, a model's ``config.yaml`` or a load call's overrides are wrong; the
    message names the file (or the call) and what is wrong."""


def _valid_name(name: object) -> bool:
    return isinstance(name, str) and bool(NAME_PATTERN.fullmatch(name)) \
        and not name.startswith(".")


def repo_path(name: str, *parts: str) -> str:
    """A file of model ``name`` as messages name it: relative to the repository root (errors
    reach admin clients, who learn the file but not the server's directories)."""
    return "/".join((name, *(parts or (CONFIG_FILE,))))


def check_name(name: str) -> str:
    """``name`` when it can name a model folder: ``[A-Za-z0-9_.-]+``, not starting with '.'."""
    if not _valid_name(name):
        raise RepositoryError(f"model name {name!r} is not valid: use letters, digits, '_', '.' "
                              "and '-', not starting with '.'")
    return name


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions on disk are served: the newest ``latest``, the ``specific``
    ones, or ``all``."""

    kind: str = "latest"
    latest: int = 1
    specific: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: Any, where: str) -> VersionPolicy:
        if not isinstance(raw, Mapping) or len(raw) != 1:
            raise RepositoryError(f"{where}: version_policy must have exactly one of latest: N, "
                                  f"specific: [versions] or all: true, got {raw!r}")
        ((kind, value),) = raw.items()
        if kind == "latest":
            return cls("latest", latest=_positive_int(value, f"{where}: version_policy.latest"))
        if kind == "specific":
            if not isinstance(value, list) or not value:
                raise RepositoryError(f"{where}: version_policy.specific must be a non-empty "
                                      f"list of versions, got {value!r}")
            versions = [_positive_int(v, f"{where}: version_policy.specific") for v in value]
            return cls("specific", specific=tuple(sorted(set(versions))))
        if kind == "all":
            if value is not True:
                raise RepositoryError(f"{where}: version_policy.all must be true, got {value!r}")
            return cls("all")
        raise RepositoryError(f"{where}: version_policy {kind!r} is unknown: use latest, "
                              "specific or all")

    def apply(self, on_disk: list[int], where: str) -> list[int]:
        """The served versions (sorted) among ``on_disk``; naming a missing one is an error."""
        if self.kind == "all":
            return list(on_disk)
        if self.kind == "latest":
            return list(on_disk[-self.latest:]) if on_disk else []
        missing = [v for v in self.specific if v not in on_disk]
        if missing:
            raise RepositoryError(f"{where}: version_policy.specific names versions {missing} "
                                  f"that have no folder (on disk: {on_disk})")
        return list(self.specific)

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "latest":
            return {"latest": self.latest}
        if self.kind == "specific":
            return {"specific": list(self.specific)}
        return {"all": True}


@dataclass(frozen=True)
class ModelDefinition:
    """A model's ``config.yaml``, parsed and checked (see the module docstring); errors name
    the file as ``where`` gives it (:func:`repo_path`)."""

    pyg_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 2
    #: neighbours per hop; None: ``sampling.fanouts``
    fanouts: list[int] | None = None
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    #: weight of unpinned requests per version (not normalised); None: all to the newest
    traffic: dict[int, float] | None = None
    random_init_seed: int = 0
    #: typed graphs: ``{"aggr": ...}`` converts the class with ``to_hetero``; None: as it is
    to_hetero: dict[str, Any] | None = None
    featureless_value: float = 1.0

    KEYS: ClassVar[tuple[str, ...]] = ("class", "kwargs", "num_layers", "fanouts",
                                       "version_policy", "traffic", "random_init_seed",
                                       "to_hetero", "featureless_value")

    @classmethod
    def from_dict(cls, raw: Any, where: str = CONFIG_FILE) -> ModelDefinition:
        """Parse a ``config.yaml`` mapping; ``where`` (the file) starts every error message."""
        if not isinstance(raw, Mapping):
            raise RepositoryError(f"{where}: must be a mapping of {', '.join(cls.KEYS)}, "
                                  f"got {type(raw).__name__}")
        unknown = sorted(str(k) for k in raw if k not in cls.KEYS)
        if unknown:
            raise RepositoryError(f"{where}: unknown keys {unknown} (known: {list(cls.KEYS)})")
        if "class" not in raw:
            raise RepositoryError(f"{where}: 'class' is required")
        pyg_class = _parse_class(raw["class"], where)
        kwargs = _parse_kwargs(raw.get("kwargs", {}), where)
        num_layers = _parse_num_layers(raw.get("num_layers"), kwargs, where)
        fanouts = _parse_fanouts(raw.get("fanouts"), num_layers, where)
        policy = VersionPolicy.parse(raw.get("version_policy", {"latest": 1}), where)
        traffic = parse_traffic(raw.get("traffic"), where)
        seed = raw.get("random_init_seed", 0)
        if not _is_int(seed):
            raise RepositoryError(f"{where}: random_init_seed must be an integer, got {seed!r}")
        featureless = raw.get("featureless_value", 1.0)
        if not isinstance(featureless, (int, float)) or isinstance(featureless, bool) or \
                not math.isfinite(featureless):
            raise RepositoryError(f"{where}: featureless_value must be a finite number, got "
                                  f"{featureless!r}")
        return cls(pyg_class, kwargs, num_layers, fanouts, policy, traffic, int(seed),
                   _parse_to_hetero(raw.get("to_hetero"), where), float(featureless))

    def with_overrides(self, overrides: Mapping[str, Any] | None, where: str) -> ModelDefinition:
        """This definition with a load call's ``version_policy`` and ``traffic``; any other key
        is refused (classes, kwargs and import paths come only from the repository's files)."""
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise RepositoryError(f"{where}: overrides must be a mapping, got {overrides!r}")
        refused = sorted(str(k) for k in overrides if k not in OVERRIDE_KEYS)
        if refused:
            raise RepositoryError(
                f"{where}: a load may set only {list(OVERRIDE_KEYS)}, not {refused}: import "
                "paths and model definitions come only from the repository's files")
        out = self
        if "version_policy" in overrides:
            out = replace(out, policy=VersionPolicy.parse(overrides["version_policy"], where))
        if "traffic" in overrides:
            out = replace(out, traffic=parse_traffic(overrides["traffic"], where))
        return out


class ModelRepository:
    """Reads the repository folder ``root``; see the module docstring. Every call reads the
    disk again (no cache), so a load sees the files as they are now."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise RepositoryError(f"models.repository {self.root} is not a folder")

    def names(self) -> list[str]:
        """Models: the sub-folders holding a ``config.yaml`` whose names are valid."""
        return sorted(entry.name for entry in self.root.iterdir()
                      if _valid_name(entry.name) and self._inside(entry)
                      and (entry / CONFIG_FILE).is_file())

    def model_dir(self, name: str) -> Path:
        """The folder of model ``name``; an invalid name, one whose folder resolves outside
        the repository, or one without a ``config.yaml`` is a RepositoryError."""
        folder = self.root / check_name(name)
        if not self._inside(folder):
            raise RepositoryError(f"model {name!r}: its folder resolves outside the repository")
        if not (folder / CONFIG_FILE).is_file():
            raise RepositoryError(f"model {name!r}: {repo_path(name)} does not exist in the "
                                  "repository")
        return folder

    def definition(self, name: str) -> ModelDefinition:
        path = self.model_dir(name) / CONFIG_FILE
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise RepositoryError(f"{repo_path(name)}: cannot be read as YAML: {exc}") from exc
        return ModelDefinition.from_dict(raw, repo_path(name))

    def versions(self, name: str) -> list[int]:
        """Versions on disk: sub-folders named by a positive integer (no leading zeros)."""
        folder = self.model_dir(name)
        return sorted(int(p.name) for p in folder.iterdir()
                      if p.is_dir() and VERSION_PATTERN.fullmatch(p.name))

    def served_versions(self, name: str, definition: ModelDefinition) -> list[int]:
        """The versions ``definition``'s policy serves, sorted."""
        return definition.policy.apply(self.versions(name), repo_path(name))

    def specs(self, name: str, overrides: Mapping[str, Any] | None = None,
              ) -> tuple[list[ModelSpec], dict[int, float]]:
        """The specs of the versions to serve (oldest first) and each one's share of unpinned
        requests (summing to 1; versions the traffic does not name get 0). ``overrides``: a
        load call's ``version_policy`` and ``traffic``, nothing else."""
        folder = self.model_dir(name)
        definition = self.definition(name).with_overrides(
            overrides, f"{repo_path(name)} (load overrides)")
        served = self.served_versions(name, definition)
        if not served:
            raise RepositoryError(f"{repo_path(name)}: no version to serve (version folders on "
                                  f"disk: {self.versions(name)})")
        weights = normalise_traffic(definition.traffic, served, repo_path(name))
        return [self._spec(name, folder, v, definition) for v in served], weights

    def index(self) -> list[dict[str, Any]]:
        """One row per (model, version on disk), and one with version None per model that has
        no version folder."""
        rows: list[dict[str, Any]] = []
        for name in self.names():
            versions = self.versions(name)
            rows.extend({"name": name, "version": v} for v in versions)
            if not versions:
                rows.append({"name": name, "version": None})
        return rows

    def _spec(self, name: str, folder: Path, version: int,
              definition: ModelDefinition) -> ModelSpec:
        weights = folder / str(version) / WEIGHTS_FILE
        label = repo_path(name, str(version), WEIGHTS_FILE)
        if not weights.is_file():
            raise RepositoryError(f"model {name!r} version {version}: {label} does not exist in "
                                  "the repository")
        return ModelSpec(name, version, definition.pyg_class, dict(definition.kwargs),
                         definition.num_layers,
                         list(definition.fanouts) if definition.fanouts is not None else None,
                         str(weights), definition.random_init_seed, str(folder), label,
                         dict(definition.to_hetero) if definition.to_hetero is not None else None,
                         definition.featureless_value)

    def _inside(self, path: Path) -> bool:
        """Whether ``path`` resolves (links followed) to an entry below the repository root."""
        try:
            resolved = path.resolve()
        except OSError:
            return False
        return resolved != self.root and resolved.is_relative_to(self.root)


def parse_traffic(raw: Any, where: str) -> dict[int, float] | None:
    """``{version: weight}`` (keys may be strings of digits, as JSON sends them); weights are
    finite, >= 0 and sum above 0. None stays None (all to the newest served version)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not raw:
        raise RepositoryError(f"{where}: traffic must be a non-empty mapping of version to "
                              f"weight, got {raw!r}")
    out: dict[int, float] = {}
    for key, weight in raw.items():
        version = int(key) if isinstance(key, str) and VERSION_PATTERN.fullmatch(key) else key
        version = _positive_int(version, f"{where}: traffic key")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight < 0:
            raise RepositoryError(f"{where}: traffic weight of version {version} must be a "
                                  f"finite number >= 0, got {weight!r}")
        out[version] = float(weight)
    if not sum(out.values()) > 0:
        raise RepositoryError(f"{where}: traffic weights must sum above 0, got {out}")
    return out


def normalise_traffic(traffic: dict[int, float] | None, served: list[int],
                      where: str) -> dict[int, float]:
    """Every served version's share (summing to 1); ``traffic`` may name served versions only."""
    if traffic is None:
        return {v: 1.0 if v == served[-1] else 0.0 for v in served}
    stray = sorted(v for v in traffic if v not in served)
    if stray:
        raise RepositoryError(f"{where}: traffic names versions {stray} that are not served "
                              f"(served: {served})")
    total = sum(traffic.values())
    return {v: traffic.get(v, 0.0) / total for v in served}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, what: str) -> int:
    if not _is_int(value) or value < 1:
        raise RepositoryError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _parse_class(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not (_CLASS_NAME.fullmatch(raw) or IMPORT_PATH.fullmatch(raw)):
        raise RepositoryError(f"{where}: class must be a class of torch_geometric.nn.models "
                              f"(GraphSAGE) or an import path (package.module:Class), got {raw!r}")
    return raw


def _parse_to_hetero(raw: Any, where: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or sorted(raw) not in ([], ["aggr"]):
        raise RepositoryError(f"{where}: to_hetero must be a mapping with only 'aggr', got "
                              f"{raw!r}")
    aggr = raw.get("aggr", "sum")
    if aggr not in TO_HETERO_AGGRS:
        raise RepositoryError(f"{where}: to_hetero.aggr must be one of {list(TO_HETERO_AGGRS)}, "
                              f"got {aggr!r}")
    return {"aggr": aggr}


def _parse_kwargs(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise RepositoryError(f"{where}: kwargs must be a mapping of argument names to values, "
                              f"got {raw!r}")
    return dict(raw)


def _parse_num_layers(raw: Any, kwargs: dict[str, Any], where: str) -> int:
    in_kwargs = kwargs.get("num_layers")
    if raw is None and in_kwargs is None:
        raise RepositoryError(f"{where}: num_layers is required (top level or in kwargs): it "
                              "sets the hops sampled per request")
    if raw is not None:
        layers = _positive_int(raw, f"{where}: num_layers")
        if in_kwargs is not None and in_kwargs != layers:
            raise RepositoryError(f"{where}: num_layers is {layers} but kwargs.num_layers is "
                                  f"{in_kwargs!r}")
        return layers
    return _positive_int(in_kwargs, f"{where}: kwargs.num_layers")


def _parse_fanouts(raw: Any, num_layers: int, where: str) -> list[int] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(_is_int(f) and (f >= 1 or f == -1) for f in raw):
        raise RepositoryError(f"{where}: fanouts must be a list of integers >= 1 or -1 (all), "
                              f"got {raw!r}")
    if len(raw) != num_layers:
        raise RepositoryError(f"{where}: fanouts has {len(raw)} hops but num_layers is "
                              f"{num_layers}: they must match (one hop per layer)")
    return [int(f) for f in raw]
