"""What ``build.py`` hands an :class:`~quiver_serve.engine.core.core.EngineCore` beside its
model, features and samplers: the objects it is made of, each owning its own state, reached only
through its public methods (docs/architecture.md, "Engine core")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from quiver_serve.engine.core.batch import SamplerPool
from quiver_serve.engine.core.forming import BatchFormer
from quiver_serve.engine.core.model_load import LoadSettings
from quiver_serve.engine.core.model_tables import ExactTables
from quiver_serve.engine.core.quiet import QuietGate, open_gate
from quiver_serve.routing.router import EngineRouter
from quiver_serve.sampling.base import BaseSampler

if TYPE_CHECKING:
    from quiver_serve.engine.core.graph_sync import GraphSync
    from quiver_serve.engine.core.overlap import PoolOverlap
    from quiver_serve.features.replace import Replacer


@dataclass
class CoreParts:
    """An engine core's parts; see the module docstring."""

    #: the waiting micro-batches and the batches formed from them (``forming.py``)
    former: BatchFormer
    #: the route of each batch, and the per-path cost model it decides by (``routing/``)
    router: EngineRouter
    #: the exact table and what a new one is built from (``model_tables.py``)
    tables: ExactTables
    #: the CPU sampler pool (the process wrapper's); None: no pool
    pool: SamplerPool | None = None
    #: the GPU sampler; None: sampling on the GPU is off
    gpu_sampler: BaseSampler | None = None
    #: route auto: batches for idle CPU samplers while the GPU is busy (``overlap.py``)
    overlap: PoolOverlap | None = None
    #: the living graph's follower (``graph_sync.py``); None: a fixed graph
    graph_sync: GraphSync | None = None
    #: feature re-placement (``features/replace.py``); None: the placement is fixed
    replacer: Replacer | None = None
    #: how model versions load while serving (``model_load.py``); None: fixed models
    loads: LoadSettings | None = None
    #: () -> (in-degree, self-loop counts) of every node now, for a GCN loaded later
    current_degrees: Callable[[], tuple[Tensor, Tensor | None]] | None = None
    #: micro-batches the core holds at most (waiting, exact or parked); more are refused 503
    max_waiting: int = 4096
    #: whether the loop is quiet, for background table work (``quiet.py``)
    quiet: QuietGate = field(default_factory=open_gate)
