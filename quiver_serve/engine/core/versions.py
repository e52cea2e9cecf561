"""Micro-batches that wait for a graph version, and inductive requests (docs/architecture.md, "The
living graph").

A micro-batch waits in ``EngineCore.parked`` while the engine core has not applied every update
acknowledged before it arrived (so a caller always reads its own acknowledged writes, and ids of
nodes it just added are known), or while its ``min_version`` is not yet visible here. At each step,
after the updates are applied, waiting micro-batches whose version is there go on as usual;
those whose every deadline passed are answered 504. Inductive requests (``new_nodes``) also pass
through here and are computed at once, alone (:func:`run_inductive`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from quiver_serve import errors
from quiver_serve.engine.core.inductive_table import inductive_rows
from quiver_serve.engine.core.micro_batch import MicroBatch, Reply
from quiver_serve.engine.core.model_tables import ExactTables
from quiver_serve.engine.core.samplers import SamplingCore
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.wire import NO_SEED, MicroBatchDone, RequestError

if TYPE_CHECKING:
    from quiver_serve.engine.core.graph_sync import GraphSync


class VersionedCore(SamplingCore, Protocol):
    """The engine core as version waits and inductive requests see it (``core.EngineCore``)."""

    num_nodes: int
    max_waiting: int
    parked: deque[MicroBatch]
    graph_sync: GraphSync | None
    tables: ExactTables

    @property
    def sample_stream(self) -> torch.cuda.Stream | None: ...

    def add(self, mb: MicroBatch) -> Reply | None: ...

    def finish_all(self) -> list[Reply]: ...


def must_wait(core: VersionedCore, mb: MicroBatch) -> bool:
    """Whether ``mb`` waits: its ``min_version`` is not visible here yet, or updates are
    acknowledged but not applied here and it names a node id this core does not know yet (a
    node just added); inductive requests always pass through ``unpark``. A request that asks
    for no version is served on the version applied here (at most one step old)."""
    sync = core.graph_sync
    assert sync is not None
    if mb.num_new_nodes or mb.min_version > sync.version:
        return True
    return bool(sync.behind() and mb.ids.size and int(mb.ids.max()) >= core.num_nodes)


def park(core: VersionedCore, mb: MicroBatch) -> Reply | None:
    if len(core.parked) >= core.max_waiting:
        return refuse_all(mb, "overloaded", "engine queue is full; retry later", 503)
    core.parked.append(mb)
    return None


def refuse_all(mb: MicroBatch, code: str, message: str, status: int) -> Reply:
    errs = [RequestError(i, code, message, status) for i in range(mb.num_requests)]
    return Reply(mb.client, MicroBatchDone(mb.seq, 0, errs), None)


def unpark(core: VersionedCore, now_s: float) -> list[Reply]:
    """Move on the parked micro-batches whose version is visible; 504 the expired ones."""
    replies: list[Reply] = []
    pending = list(core.parked)
    core.parked.clear()
    sync = core.graph_sync
    assert sync is not None
    for mb in pending:
        if mb.deadlines_s.size and float(mb.deadlines_s.max()) <= now_s:
            replies.append(refuse_all(mb, *errors.DEADLINE))
        elif mb.min_version > sync.version or (sync.behind() and _names_unknown(core, mb)):
            core.parked.append(mb)
        elif mb.num_new_nodes:
            replies += run_inductive(core, mb)
        else:
            refused = core.add(mb)
            if refused is not None:
                replies.append(refused)
    return replies


def _names_unknown(core: VersionedCore, mb: MicroBatch) -> bool:
    """Ids (or inductive in-neighbours) at or past the node count applied here."""
    n = core.num_nodes
    known = not mb.ids.size or int(mb.ids.max()) < n
    if mb.new_neighbors is not None and mb.new_neighbors.size:
        known = known and int(mb.new_neighbors.max()) < n
    return not known


# ---- inductive requests ----------------------------------------------------------------------------
def run_inductive(core: VersionedCore, mb: MicroBatch) -> list[Reply]:
    """Embeddings of ``mb.ids`` and of new nodes that are not added: each new node is given a
    temporary id past the graph's nodes, its in-edges and its feature row, the batch is sampled
    and computed on the current graph plus those nodes, then the temporary nodes are removed.
    Nothing else runs meanwhile (the GPU's batches are finished first)."""
    replies = core.finish_all()
    sync = core.graph_sync
    assert sync is not None and mb.slot is not None
    assert mb.new_features is not None and mb.new_offsets is not None \
        and mb.new_neighbors is not None
    problem = _check_inductive(core, mb)
    if problem is not None:
        return replies + [refuse_all(mb, *problem)]
    n = sync.overlay.num_nodes
    rows = _from_table(core, mb, n)
    if rows is not None:
        done = MicroBatchDone(mb.seq, int(rows.shape[1]), model=mb.slot.name,
                              version=mb.slot.version)
        return replies + [Reply(mb.client, done, rows)]
    virtual = np.arange(n, n + mb.num_new_nodes, dtype=np.int64)
    try:
        with sync.virtual_nodes(core, virtual, mb.new_offsets, mb.new_neighbors, mb.new_features):
            rows = _forward(core, np.concatenate([mb.ids, virtual]), mb)
    except errors.ServeError as exc:
        return replies + [refuse_all(mb, exc.info.code, exc.info.message, exc.info.status)]
    done = MicroBatchDone(mb.seq, int(rows.shape[1]), model=mb.slot.name,
                          version=mb.slot.version)
    return replies + [Reply(mb.client, done, rows)]


def _from_table(core: VersionedCore, mb: MicroBatch, first_new: int) -> np.ndarray | None:
    """An exact inductive request's rows from the exact table, when it can give them
    (``inductive_table.py``); None otherwise."""
    assert mb.slot is not None
    table = core.tables.table
    if not mb.exact or table is None or not core.tables.serves(mb.slot.served):
        return None
    assert mb.new_features is not None and mb.new_offsets is not None \
        and mb.new_neighbors is not None
    rows = inductive_rows(table, mb.ids, mb.new_features, mb.new_offsets, mb.new_neighbors,
                          first_new, core.features.dtype)
    if rows is not None:
        table.counters.from_table += 1
    return rows


def _check_inductive(core: VersionedCore, mb: MicroBatch) -> tuple[str, str, int] | None:
    assert core.graph_sync is not None
    n = core.graph_sync.overlay.num_nodes
    for name, ids in (("node_ids", mb.ids), ("in_neighbors", mb.new_neighbors)):
        if ids is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            return ("invalid_node_ids", f"{name}: {errors.out_of_range_message(bad, n)}", 400)
    offsets = mb.new_offsets
    assert offsets is not None and mb.new_features is not None and mb.new_neighbors is not None
    if offsets.size != mb.num_new_nodes + 1 or int(offsets[0]) != 0 \
            or int(offsets[-1]) != mb.new_neighbors.size or bool((np.diff(offsets) < 0).any()):
        return ("invalid_request", "malformed new_nodes neighbour offsets", 400)
    if mb.new_features.shape[1] != core.features.dim:
        return ("invalid_features", f"new_nodes features have {mb.new_features.shape[1]} "
                f"values; this graph's features have {core.features.dim}", 422)
    return None


def _forward(core: VersionedCore, seeds: np.ndarray, mb: MicroBatch) -> np.ndarray:
    sampler = core.gpu_sampler or core.local_sampler
    assert mb.slot is not None
    fanouts = [-1] * len(mb.slot.fanouts) if mb.exact else mb.slot.fanouts
    seed = mb.seed if mb.seed != NO_SEED else new_batch_seed()
    stream = core.sample_stream
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        sb = sampler.sample(torch.from_numpy(seeds), fanouts, seed)
        n_id = sb.n_id.to(core.device)
        x = core.features.gather(n_id)
        out = mb.slot.served(x, n_id, sb.edge_index.to(core.device, torch.int64),
                         sb.num_sampled_nodes, sb.num_sampled_edges, mb.exact)
        rows = out.index_select(0, sb.seed_index.to(core.device)).float().cpu()
    return rows.numpy()

