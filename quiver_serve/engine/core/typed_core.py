"""The engine core of a typed graph (docs/architecture.md, "Typed graphs"; decision 0046).

Driven like ``EngineCore`` (``add`` a micro-batch, ``step()`` returns replies), on the typed
library: micro-batches name a node type (``MicroBatch.node_type``; "" is the only type of a
one-type graph), are batched with others of the same type and mode, sampled with the typed
sampler (``sampling/typed.py``) and run through the typed model (``models/typed_served.py``),
trimmed per layer when the layer runner serves the model (``TypedLayerwise.sampled``). Exact
requests read a per-type table of every node's layer-wise output (``TypedLayerwise.run``) when
``exact.materialize`` is on, else are computed on the fly from a sample with every fanout -1
(every in-neighbour: exact). A one-type graph keeps the homogeneous core (``build.py``).

With the living graph (``sync``, ``typed_sync.py``) each step first applies new updates; a
micro-batch whose ``min_version`` is not applied here yet, or that names an id past its type's
applied count while updates are pending, waits in ``parked`` until they are (504 at its
deadline). The exact table (``typed_table.py``) follows the updates: each step marks the rows
what it applied made stale and refreshes marked rows within ``graph.apply_budget_ms`` while
requests wait (longer when none does); an exact request's marked rows are computed from a
sample with every fanout -1 until the refresh reaches them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.micro_batch import (
    MicroBatch,
    Reply,
    check_ids,
    failed_replies,
    malformed,
    prune,
    refused_whole,
    split_rows,
)
from quiver_serve.engine.core.typed_inductive_table import changed_destinations, inductive_rows
from quiver_serve.engine.core.typed_sync import TypedSync
from quiver_serve.engine.core.typed_table import TypedExactTable, rows_or_none
from quiver_serve.graph.typed import EdgeType, TypedGraph
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_virtual import in_edges, virtual_nodes
from quiver_serve.models.norms import exact_refusal
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise, unsupported
from quiver_serve.models.typed_served import TypedServedModel, build_typed_model
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.sampling.typed import TypedCppSampler, TypedReferenceSampler, typed_fanouts
from quiver_serve.wire import NO_SEED, RELATION_SHIFT, MicroBatchDone

log = logging.getLogger(__name__)


def is_typed(graph: TypedGraph, spec: ModelSpec) -> bool:
    """Whether the typed core serves ``graph``: several node types, or a model made or written
    for typed inputs (``model.to_hetero`` or a module taking dicts)."""
    return len(graph.node_types) > 1 or spec.to_hetero is not None or \
        len(graph.edge_types) > 1


def unknown_type_message(node_type: str, known: list[str]) -> str:
    return f"unknown node_type {node_type[:128]!r}: the graph's node types are {known}"


@dataclass
class TypedSettings:
    """What the typed core takes from the configuration."""

    max_batch_nodes: int
    max_waiting: int
    materialize: bool
    #: time a step may spend applying updates while requests wait (``graph.apply_budget_ms``)
    apply_budget_s: float = 0.005
    #: time a step may spend refreshing the exact table when no request waits
    idle_refresh_s: float = 0.05
    #: in-edges per exact-table refresh chunk (``exact.refresh_chunk_edges``)
    refresh_chunk_edges: int = 1 << 20
    #: the graph keeps reverse relations (``graph.add_reverse_edges``): new nodes' in-edges
    #: derive their reverse as updates do
    add_reverse_edges: bool = False
    #: SAGE convs without ``propagate`` (``inference.fast_model``)
    fast_model: bool = True
    #: sampled batches up to this many seeds run wholly on the CPU in a GPU core
    #: (``inference.typed_cpu_max_seeds``; -1: measured at start)
    cpu_max_seeds: int = -1

    @classmethod
    def of(cls, cfg: ServeConfig) -> TypedSettings:
        return cls(cfg.batching.max_batch_nodes, cfg.batching.queue_capacity,
                   cfg.exact.materialize != "off", cfg.graph.apply_budget_ms / 1000.0,
                   refresh_chunk_edges=cfg.exact.refresh_chunk_edges,
                   add_reverse_edges=cfg.graph.add_reverse_edges,
                   fast_model=cfg.inference.fast_model,
                   cpu_max_seeds=cfg.inference.typed_cpu_max_seeds)


class TypedEngineCore:
    """Stage logic of one engine core on a typed graph; see the module docstring."""

    def __init__(self, served: TypedServedModel, fanouts: dict, sampler: TypedReferenceSampler,
                 settings: TypedSettings, *, index: int = 0) -> None:
        self.served, self.graph, self.sampler = served, served.graph, sampler
        self.fanouts = typed_fanouts(self.graph, fanouts)
        self.all_fanouts = {et: [-1] * len(f) for et, f in self.fanouts.items()}
        self.settings, self.index = settings, index
        self.layerwise = TypedLayerwise(served, settings.fast_model) \
            if unsupported(served) is None else None
        #: why exact answers cannot be given (a norm over every node of a graph makes a row
        #: depend on the whole graph, not on its L-hop neighbourhood), or None
        self.no_exact = exact_refusal(served.spec.label, served.model)
        #: every node's exact rows per layer and node type (None: exact requests computed on
        #: the fly)
        self.table: TypedExactTable | None = None
        self.waiting: deque[MicroBatch] = deque()
        self.out_dims = dict(served.out_dims)
        #: sends replies at once (the process loop's socket); None: ``step()`` returns them
        self.send_now = None
        #: follows the update log (None: the graph does not change)
        self.sync: TypedSync | None = None
        #: micro-batches waiting for a version (``min_version``, ids of nodes not applied yet)
        self.parked: deque[MicroBatch] = deque()
        #: the living graph's rules (reverse relations) for inductive requests' new nodes
        self.rules = TypedLiveGraph(self.graph, settings.add_reverse_edges, keep_features=False)

    def ids_in_hand(self) -> int:
        """Ids waiting here from every client (the clients spread load by it)."""
        return sum(mb.num_ids for mb in self.waiting)

    @property
    def node_types(self) -> list[str]:
        return self.graph.node_types

    def build_table(self) -> None:
        """Every node's exact rows per type, layer by layer (``TypedLayerwise.run``)."""
        if self.layerwise is None:
            log.warning("engine %d: the typed model is not served layer by layer: exact "
                        "requests are computed on the fly", self.index)
            return
        t0 = time.perf_counter()
        self.table = TypedExactTable(self.layerwise, self.settings.refresh_chunk_edges)
        self.table.follow_reverse(self.rules)  # the reverse relations' CSCs hold out-edges
        log.info("engine %d: typed exact table of %d layer(s), final rows %s, in %.2f s",
                 self.index, self.table.num_layers,
                 {t: tuple(r.shape) for t, r in self.table.layer(-1).items()},
                 time.perf_counter() - t0)

    def resolve_type(self, node_type: str) -> str | None:
        """The node type a request names ("" is the only type of a one-type graph); None when
        the graph has no such type."""
        if not node_type and len(self.node_types) == 1:
            return self.node_types[0]
        return node_type if node_type in self.graph.num_nodes else None

    def add(self, mb: MicroBatch) -> Reply | None:
        """Take a micro-batch in; a reply at once when it is refused whole (unknown node type,
        queue full, malformed), else None. Ids out of range refuse their own requests (400)."""
        bad = malformed(mb)
        if bad is not None:
            return bad
        node_type = self.resolve_type(mb.node_type)
        if node_type is None:
            msg = (f"node_type is required: the graph's node types are {self.node_types}"
                   if not mb.node_type else unknown_type_message(mb.node_type, self.node_types))
            return refused_whole(mb, "invalid_node_type", msg, 400)
        if len(self.waiting) + len(self.parked) >= self.settings.max_waiting:
            return refused_whole(mb, "overloaded", "engine queue is full; retry later", 503)
        if mb.exact and self.no_exact is not None:
            return refused_whole(mb, "exact_unsupported", self.no_exact, 422)
        mb.node_type = node_type
        if self._must_wait(mb):
            self.parked.append(mb)
            return None
        valid, errs = check_ids(mb, self.graph.num_nodes[node_type])
        mb.valid, mb.errors = valid, errs
        mb.min_deadline_s = float(mb.deadlines_s.min()) if mb.num_requests else 0.0
        self.waiting.append(mb)
        return None

    def busy(self) -> bool:
        return bool(self.waiting)

    def refreshing(self) -> bool:
        """The exact table has rows to recompute (the loop keeps stepping)."""
        return self.table is not None and self.table.stale_count() > 0

    def _must_wait(self, mb: MicroBatch) -> bool:
        sync = self.sync
        if sync is None:
            return False
        if mb.min_version > sync.version:
            return True
        if not sync.behind():
            return False
        if mb.ids.size and int(mb.ids.max()) >= self.graph.num_nodes[mb.node_type]:
            return True
        return bool(mb.num_new_nodes) and self._sources_ahead(mb)

    def _sources_ahead(self, mb: MicroBatch) -> bool:
        """An inductive micro-batch names a source past its type's applied count (a node an
        acknowledged update added that this core has not applied yet)."""
        try:
            edges = self._new_in_edges(mb, check_ranges=False)
        except errors.ServeError:
            return False  # refused by name when it runs
        return any(src.numel() and int(src.max()) >= self.graph.num_nodes[et[0]]
                   for et, (src, _) in edges.items())

    def follow(self) -> list[Reply]:
        """Apply new updates (see the module docstring), then move on the parked micro-batches
        whose version is here; 504 those whose every deadline passed."""
        if self.sync is None:
            return []
        budget_s = self.settings.apply_budget_s if self.waiting else float("inf")
        table = self.table
        if table is not None and self.sync.live.changes is None:
            self.sync.live.watch_changes()  # the table holds the graph as it is now
            table.follow_reverse(self.sync.live)
        if self.sync.step(budget_s) and table is not None:
            table.mark(self.sync.live.take_changes())
        if table is not None and table.stale_count():
            table.refresh(self.settings.apply_budget_s if self.waiting
                          else self.settings.idle_refresh_s)
        replies: list[Reply] = []
        now_s = time.time()
        pending, self.parked = self.parked, deque()
        for mb in pending:
            if mb.deadlines_s.size and float(mb.deadlines_s.max()) <= now_s:
                replies.append(refused_whole(mb, *errors.DEADLINE))
            elif self._must_wait(mb):
                self.parked.append(mb)
            else:
                mb.valid, mb.errors = check_ids(mb, self.graph.num_nodes[mb.node_type])
                mb.min_deadline_s = float(mb.deadlines_s.min()) if mb.num_requests else 0.0
                self.waiting.append(mb)
        return replies

    def step(self) -> list[Reply]:
        """Apply updates and move on parked micro-batches (``follow``), then form one batch of
        waiting micro-batches (same node type and mode; a seeded micro-batch alone), run it,
        and answer it."""
        parked = self.follow()
        if not self.waiting:
            return parked
        first = self.waiting.popleft()
        group = [first]
        total = first.num_ids
        if first.seed == NO_SEED and not first.num_new_nodes:  # those travel alone
            keep: deque[MicroBatch] = deque()
            while self.waiting:
                mb = self.waiting.popleft()
                if (mb.node_type, mb.exact, mb.seed) == (first.node_type, first.exact, NO_SEED) \
                        and not mb.num_new_nodes \
                        and total + mb.num_ids <= self.settings.max_batch_nodes:
                    group.append(mb)
                    total += mb.num_ids
                else:
                    keep.append(mb)
            self.waiting = keep
        return parked + self._run(group)

    def _run(self, group: list[MicroBatch]) -> list[Reply]:
        if group[0].num_new_nodes:
            return [self._run_inductive(group[0])]
        parts = [prune(mb, time.time()) for mb in group]
        ids = [p.alive_ids() for p in parts]
        node_type, exact = group[0].node_type, group[0].exact
        seed = group[0].seed if group[0].seed != NO_SEED else new_batch_seed()
        seeds = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        try:
            rows = self.rows(node_type, torch.from_numpy(seeds), exact, seed)
        except Exception as exc:  # noqa: BLE001 - every request of the batch hears it
            log.exception("engine %d: typed batch failed", self.index)
            return failed_replies(parts, "internal", f"{type(exc).__name__}: {exc}", 500)
        replies = []
        for part, chunk in zip(parts, split_rows(parts, rows), strict=True):
            dim = int(rows.shape[1]) if part.num_alive else 0
            replies.append(Reply(part.mb.client, MicroBatchDone(
                part.mb.seq, dim, part.errors, model=self.served.spec.name,
                version=self.served.spec.version), chunk if dim else None))
        return replies

    def _new_in_edges(self, mb: MicroBatch, check_ranges: bool = True) -> dict:
        """Per relation, (sources, new node index) of ``mb``'s new nodes: each neighbour word
        holds its relation's index from ``RELATION_SHIFT`` up and the source id below."""
        words = mb.new_neighbors
        assert words is not None and mb.new_offsets is not None
        return in_edges(self.rules, mb.node_type, mb.new_offsets, words >> RELATION_SHIFT,
                        words & ((1 << RELATION_SHIFT) - 1), mb.new_relations, check_ranges)

    def _run_inductive(self, mb: MicroBatch) -> Reply:
        """Rows of ``mb``'s ids and then of its new nodes, on the graph with those nodes added
        for this batch only (``graph/typed_virtual.py``; decision 0061): sampled, or exact from
        full-fanout samples (the table holds the graph without them)."""
        if mb.errors:
            first = mb.errors[0]
            return refused_whole(mb, first.code, first.message, first.status)
        if float(mb.deadlines_s.max()) <= time.time():
            return refused_whole(mb, *errors.DEADLINE)
        assert mb.new_features is not None and mb.new_offsets is not None \
            and mb.new_neighbors is not None
        node_type, count = mb.node_type, mb.num_new_nodes
        seed = mb.seed if mb.seed != NO_SEED else new_batch_seed()
        try:
            rows = torch.from_numpy(self.rules.check_rows(node_type, mb.new_features))
            edges = self._new_in_edges(mb)
            with virtual_nodes(self.rules, node_type, count, edges) as new_ids:
                self.served.virtual_rows = {node_type: (int(new_ids[0]), rows)}
                ids = torch.from_numpy(mb.ids.astype(np.int64))
                out = self._inductive_from_table(mb, ids, new_ids, edges)
                if out is None:
                    out = self.sampled_rows(node_type, torch.cat([ids, new_ids]), mb.exact, seed)
        except errors.ServeError as exc:
            return refused_whole(mb, exc.info.code, exc.info.message, exc.info.status)
        except IndexError as exc:  # a model reading per-node parameters (an embedding table)
            return refused_whole(mb, "invalid_new_nodes", f"the model cannot embed new nodes of "
                                 f"type {node_type!r}: {exc}", 422)
        finally:
            self.served.virtual_rows = {}
        done = MicroBatchDone(mb.seq, int(out.shape[1]), [], model=self.served.spec.name,
                              version=self.served.spec.version)
        return Reply(mb.client, done, out)

    @torch.no_grad()
    def _inductive_from_table(self, mb: MicroBatch, ids: Tensor, new_ids: Tensor,
                              edges: dict[EdgeType, tuple[Tensor, Tensor]]) -> np.ndarray | None:
        """An exact inductive request's rows from the table when it can give them (decision
        0064, ``typed_inductive_table.py``); None otherwise."""
        if not mb.exact or self.table is None or self.layerwise is None \
                or mb.node_type not in self.table.types():
            return None
        changed = changed_destinations(self.rules, mb.node_type, new_ids, edges)
        return inductive_rows(self.table, self.layerwise, mb.node_type, ids, new_ids, changed)

    @torch.no_grad()
    def rows(self, node_type: str, seeds: Tensor, exact: bool, seed: int) -> np.ndarray:
        """float32 [len(seeds), dim]: the rows of ``seeds`` of ``node_type``, exact or from a
        sample drawn with ``seed``."""
        if seeds.numel() == 0:
            return np.zeros((0, self.out_dims.get(node_type, 0)), np.float32)
        if exact and self.table is not None:
            if node_type not in self.table.types():
                raise ValueError(f"the model gives no rows for node type {node_type!r}")
            rows, stale = rows_or_none(self.table, node_type, seeds)
            if rows is not None and bool(stale.any()):  # the refresh has not reached them
                rows[stale.numpy()] = self.sampled_rows(node_type, seeds[stale], True, seed)
            return rows
        return self.sampled_rows(node_type, seeds, exact, seed)

    def sampled_rows(self, node_type: str, seeds: Tensor, exact: bool, seed: int) -> np.ndarray:
        """The rows of ``seeds`` from a sample drawn with ``seed`` (exact: every fanout -1)."""
        out = self.sampler.sample(node_type, seeds, self.all_fanouts if exact else self.fanouts,
                                  seed)
        result = self.layerwise.sampled(out) if self.layerwise is not None else self.served(out)
        return result.float().cpu().numpy()


def build_typed_core(cfg: ServeConfig, graph: TypedGraph, index: int = 0,
                     spec: ModelSpec | None = None) -> TypedEngineCore:
    """The typed engine core of ``cfg`` on ``graph``: the model (weights-only, probe forward),
    the C++ typed sampler (the reference with ``sampling.implementation: reference``), and the
    exact table when ``exact.materialize`` is not off."""
    spec = spec or ModelSpec.from_config(cfg.model)
    served = build_typed_model(spec, graph)
    sampler_cls = TypedReferenceSampler if cfg.sampling.implementation == "reference" \
        else TypedCppSampler
    fanouts = cfg.sampling.fanouts if spec.fanouts is None else spec.fanouts
    settings = TypedSettings.of(cfg)
    core = TypedEngineCore(served, fanouts, sampler_cls(graph), settings, index=index)
    if settings.materialize:
        core.build_table()
    return core
