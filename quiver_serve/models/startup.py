"""Which models and versions a daemon serves when it starts (docs/architecture.md, "Models and
versions").

Without ``models.repository`` the ``model:`` section is the one model, version 1. With one, every
model of ``models.load_at_start`` (default: all of the repository's) is served per its
``version_policy`` and ``traffic``; ``models.default`` (default: ``model.name`` when the repository
has it, else the first model) answers requests that name no model. The main process and every
engine core compute the same plan from the same files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiver_serve.config import ServeConfig, resolve_path
from quiver_serve.models.spec import CONFIG_VERSION, ModelSpec


@dataclass
class ModelPlan:
    """One model's served versions and the weights of its unpinned requests."""

    name: str
    specs: list[ModelSpec]
    traffic: dict[int, float] = field(default_factory=dict)


@dataclass
class StartPlan:
    default: str
    models: list[ModelPlan]

    def primary(self) -> ModelSpec:
        """The version the engine core builds first: the default model's main version (the
        largest traffic weight, then the newest), which the calibration and the exact table
        are made for."""
        for plan in self.models:
            if plan.name == self.default and plan.specs:
                return max(plan.specs, key=lambda s: (plan.traffic.get(s.version, 0.0),
                                                      s.version))
        raise ValueError(f"models.default {self.default!r} has no version to serve")

    def others(self) -> list[ModelSpec]:
        first = self.primary()
        return [s for plan in self.models for s in plan.specs if s.key != first.key]

    def to_dict(self) -> dict[str, Any]:
        return {"default": self.default,
                "models": [{"name": m.name, "specs": [s.to_dict() for s in m.specs],
                            "traffic": {str(v): w for v, w in m.traffic.items()}}
                           for m in self.models]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StartPlan:
        return cls(raw["default"], [
            ModelPlan(m["name"], [ModelSpec.from_dict(s) for s in m["specs"]],
                      {int(v): float(w) for v, w in m["traffic"].items()})
            for m in raw["models"]])


def save_plan(plan: StartPlan, path: Path) -> None:
    """Write ``plan`` where a restarted engine core reads it (atomically)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan.to_dict()))
    os.replace(tmp, path)


def current_plan(cfg: ServeConfig, path: Path | None) -> StartPlan:
    """The plan the main process saved (what serves now, after loads and unloads), else the
    start-up plan from the config and the repository."""
    if path is not None and path.exists():
        return StartPlan.from_dict(json.loads(path.read_text()))
    return start_plan(cfg)


def start_plan(cfg: ServeConfig) -> StartPlan:
    """What to serve at start-up; ValueError (naming the file) when the repository is wrong."""
    if cfg.models.repository is None:
        spec = ModelSpec.from_config(cfg.model)
        return StartPlan(spec.name, [ModelPlan(spec.name, [spec], {CONFIG_VERSION: 1.0})])
    from quiver_serve.models.repository import ModelRepository

    repo = ModelRepository(resolve_path(cfg.models.repository))
    names = repo.names()
    if not names:
        raise ValueError(f"model repository {cfg.models.repository} holds no model "
                         "(one folder per model, each with a config.yaml)")
    wanted = names if cfg.models.load_at_start is None else cfg.models.load_at_start
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ValueError(f"models.load_at_start names {missing}, which the repository "
                         f"{cfg.models.repository} does not hold (it holds {names})")
    default = cfg.models.default or (cfg.model.name if cfg.model.name in wanted else wanted[0])
    if default not in wanted:
        raise ValueError(f"models.default {default!r} is not loaded at start "
                         f"(models.load_at_start: {wanted})")
    plans = []
    for name in wanted:
        specs, traffic = repo.specs(name)
        plans.append(ModelPlan(name, specs, traffic))
    return StartPlan(default, plans)
