"""One servable model version, as the engine cores build it: :class:`ModelSpec`.

A spec comes from the ``model:`` config section (the embedded default, version 1) or from the
operator's model repository (``models/repository.py``). It names what to build (a class of
``torch_geometric.nn.models`` or an import path from the operator's files), its kwargs, its depth
and fanouts, and the weights-only ``state_dict`` to load. Specs are plain data (msgpack-safe
through :meth:`to_dict`), so the main process can send one to every engine core.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from quiver_serve.config import ModelConfig, resolve_path

#: version of the model named by the ``model:`` config section
CONFIG_VERSION = 1
#: ``package.module:Class`` (the class part may be dotted: ``module:Outer.Inner``)
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class ModelSpec:
    """What an engine core builds for one (model, version)."""

    name: str
    version: int
    #: a class of ``torch_geometric.nn.models`` ("GraphSAGE") or "package.module:Class"
    pyg_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: message-passing layers (hops of the sampled subgraph and of exact mode)
    num_layers: int = 2
    #: neighbours per hop; None: ``sampling.fanouts``
    fanouts: list[int] | None = None
    #: absolute path of the weights-only ``state_dict``; None: random init (``random_init_seed``)
    weights: str | None = None
    random_init_seed: int = 0
    #: folder searched first for the module of an import path (the model's repository folder)
    module_dir: str | None = None
    #: the weights file as clients may see it (relative to the repository or the checkout)
    weights_label: str | None = None
    #: typed graphs: ``{"aggr": "sum"}`` converts the class with PyG's ``to_hetero`` (None: as is)
    to_hetero: dict[str, Any] | None = None
    #: typed graphs: the one feature column of node types without features
    featureless_value: float = 1.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)

    @property
    def is_import_path(self) -> bool:
        return ":" in self.pyg_class

    @property
    def label(self) -> str:
        """How messages name this version: ``model 'sage' version 2``."""
        return f"model {self.name!r} version {self.version}"

    def fanouts_or(self, default: list[int]) -> list[int]:
        return list(self.fanouts) if self.fanouts is not None else list(default)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelSpec:
        return cls(**raw)

    @classmethod
    def coerce(cls, value: ModelSpec | ModelConfig) -> ModelSpec:
        """``value`` itself, or the ``model:`` section as a spec (:meth:`from_config`)."""
        return value if isinstance(value, ModelSpec) else cls.from_config(value)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelSpec:
        """The ``model:`` section as version 1 of ``cfg.name``."""
        weights = str(resolve_path(cfg.weights)) if cfg.weights is not None else None
        return cls(cfg.name, CONFIG_VERSION, cfg.pyg_class, dict(cfg.kwargs), cfg.num_layers,
                   None, weights, cfg.random_init_seed, None, cfg.weights,
                   dict(cfg.to_hetero) if cfg.to_hetero is not None else None,
                   cfg.featureless_value)
