"""The models an engine core serves: one :class:`ModelSlot` per (model, version), and the
:class:`ModelTable` that resolves a micro-batch's (model, version) to one of them
(docs/architecture.md, "Models and versions").

Every slot shares the engine core's graph, samplers and feature store; a slot holds only what is
the model's own: its ``ServedModel`` (PyG module, fast layers), its CUDA graphs and its fanouts.

Resolution happens once per micro-batch, at intake, so every request finishes on the version it
was given even when a load or an unload lands meanwhile:

* a pinned version must be loaded (404 ``model_version_not_found``) and not draining (503
  ``model_version_unavailable``);
* an unpinned micro-batch goes to one of the model's active versions by their traffic weights.
  The split is a deficit count over requests (each micro-batch goes to the version furthest below
  its share), so after ``N`` requests every version's count is within one micro-batch of
  ``weight * N``: a 1% canary gets 1% of the requests, not a random number near it.

A slot's states: ``READY`` (serving; takes unpinned requests when its weight is above 0),
``DRAINING`` (unloaded: what it holds finishes, nothing new comes), then released.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from quiver_serve.engine.core.exact_table import ExactTable
from quiver_serve.models.graphed import GraphedForward
from quiver_serve.models.norms import exact_refusal
from quiver_serve.models.served import ServedModel
from quiver_serve.models.spec import ModelSpec

READY, DRAINING = "READY", "DRAINING"


class Hold:
    """One hold on the core's updates, asked for by a loader thread, given by the loop."""

    def __init__(self) -> None:
        self.given = threading.Event()
        self.since_s = 0.0
        self.active = False


@dataclass(eq=False)
class ModelSlot:
    """One loaded (model, version) in one engine core."""

    spec: ModelSpec
    served: ServedModel
    fanouts: list[int]
    graphed: GraphedForward | None = None
    state: str = READY
    #: share of the model's unpinned requests (normalised over its active versions)
    weight: float = 0.0
    #: unpinned requests given to this slot since the weights were last set
    assigned: int = 0
    #: when it began draining (``time.monotonic()``); 0 while serving
    drain_since_s: float = 0.0
    #: what the load measured: build, CUDA graphs, warm-up (seconds)
    load_s: dict[str, float] = field(default_factory=dict)
    #: an exact table built with the load, waiting for this version to take the model's
    #: traffic (``model_load.ModelLoads.follow_table``); updates are held meanwhile
    pending_table: ExactTable | None = None
    #: the hold on updates this slot's pending table has (``model_tables.take_hold``)
    hold: Hold | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def no_exact(self) -> str | None:
        """Why this model gives no exact answers (a graph-wide norm), or None; found once."""
        return exact_refusal(self.spec.label, self.served.model)

    @property
    def version(self) -> int:
        return self.spec.version

    @property
    def key(self) -> tuple[str, int]:
        return self.spec.key

    @property
    def dim(self) -> int:
        return self.served.out_dim

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "state": self.state,
                "weight": self.weight, "dim": self.dim, "fanouts": self.fanouts,
                "cuda_graphs": self.graphed.max_seeds if self.graphed is not None else 0,
                "fast_layers": self.served.fast is not None, "load_s": dict(self.load_s)}


@dataclass(frozen=True)
class Refusal:
    """Why a micro-batch's (model, version) cannot be served: every request gets this."""

    code: str
    message: str
    status: int


class ModelTable:
    """Every slot of one engine core, by (name, version); see the module docstring."""

    def __init__(self, default: str) -> None:
        self.default = default
        self.slots: dict[tuple[str, int], ModelSlot] = {}
        self._total: dict[str, int] = {}  # unpinned requests per model since its weights were set

    def add(self, slot: ModelSlot) -> None:
        if slot.key in self.slots:
            raise ValueError(f"model {slot.name!r} version {slot.version} is loaded already")
        self.slots[slot.key] = slot

    def remove(self, slot: ModelSlot) -> None:
        self.slots.pop(slot.key, None)

    def get(self, name: str, version: int) -> ModelSlot | None:
        return self.slots.get((name, version))

    def of(self, name: str) -> list[ModelSlot]:
        return sorted((s for s in self.slots.values() if s.name == name), key=lambda s: s.version)

    def each(self) -> list[ModelSlot]:
        return list(self.slots.values())

    def draining(self) -> list[ModelSlot]:
        return [s for s in self.slots.values() if s.state == DRAINING]

    def set_traffic(self, name: str, weights: dict[int, float]) -> None:
        """Weights of ``name``'s unpinned requests per version (normalised; versions not named
        take none); the deficit counts start again."""
        total = sum(w for v, w in weights.items() if self.get(name, v) is not None and w > 0)
        for slot in self.of(name):
            w = weights.get(slot.version, 0.0)
            slot.weight = w / total if total > 0 and w > 0 and slot.state == READY else 0.0
            slot.assigned = 0
        self._total[name] = 0

    def resolve(self, model: str, version: int, num_requests: int) -> ModelSlot | Refusal:
        """The slot a micro-batch of ``num_requests`` requests runs on, or why none."""
        if not version and len(self.slots) == 1:  # one version served: nothing to choose
            only = next(iter(self.slots.values()))
            if only.name == (model or self.default) and only.state == READY:
                return only
        name = model or self.default
        slots = self.of(name)
        if not slots:
            known = sorted({s.name for s in self.slots.values()})
            return Refusal("model_not_found",
                           f"no model named {name!r} is loaded; loaded models: {known}", 404)
        if version:
            return _pinned(name, version, slots)
        active = [s for s in slots if s.state == READY and s.weight > 0]
        if not active:
            ready = [s for s in slots if s.state == READY]
            if not ready:
                return Refusal("model_version_unavailable",
                               f"every version of model {name!r} is being unloaded", 503)
            return ready[-1]  # no split set: the newest version
        total = self._total.get(name, 0) + num_requests
        self._total[name] = total
        best = max(active, key=lambda s: s.weight * total - s.assigned)
        best.assigned += num_requests
        return best


def _pinned(name: str, version: int, slots: list[ModelSlot]) -> ModelSlot | Refusal:
    for slot in slots:
        if slot.version == version:
            if slot.state != READY:
                return Refusal("model_version_unavailable",
                               f"model {name!r} version {version} is being unloaded", 503)
            return slot
    loaded = [s.version for s in slots if s.state == READY]
    return Refusal("model_version_not_found",
                   f"model {name!r} has no version {version} loaded; loaded versions: {loaded}",
                   404)
