"""The exact table (docs/architecture.md, "The exact table"): every node's exact embedding,
materialised and kept fresh.

Exact embeddings are a pure function of (graph version, model). :class:`ExactTable` computes
every layer's output for every node by layer-wise full-graph inference (chunks of target nodes,
every in-edge, ``models/layerwise.py``), keeps them in GPU memory (or pinned host memory when
they exceed ``exact.gpu_bytes``), and answers an exact request with one row gather.

Freshness. Each engine core applies the update log itself (``graph_sync.py``); after the records
of a step are applied, :meth:`ExactTable.mark` marks what they can change, layer by layer: a node
whose feature row was written changes its layer-0 row; a node whose in-list changed changes its
own row at every layer (and, with GCN's degree normalisation, its out-neighbours' too); a changed
row at layer ``l - 1`` changes its out-neighbours' rows at layer ``l``. The last layer's marked
rows are *stale*: the engine answers requests that name one by the on-the-fly exact path, never
from the table, until a refresh round (``table_refresh.py``, a background thread) has recomputed
them. So every answer, from the table or not, is exact for the version the engine core serves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import ExactConfig
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.device_overlay import DeviceOverlay
from quiver_serve.graph.neighbourhood import CurrentGraph, OutIndex, split_by_edges
from quiver_serve.graph.overlay import Overlay
from quiver_serve.models.layerwise import LayerwiseModel, unsupported
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.base import BaseSampler

log = logging.getLogger(__name__)

#: bytes per stored value (every layer fp32: exactness to 1e-5 leaves no room for fp16)
VALUE_BYTES = 4
#: target rows per chunk at most (nodes without in-edges cost rows, not edges)
MAX_CHUNK_ROWS = 1 << 20


def table_bytes(num_nodes: int, dims: list[int]) -> int:
    return int(num_nodes) * sum(dims) * VALUE_BYTES


def placement(cfg: ExactConfig, device: torch.device, num_bytes: int) -> str | None:
    """Where the table lives ("gpu", "host"), or None when it is not built."""
    if cfg.materialize == "off":
        return None
    if device.type == "cuda" and num_bytes <= cfg.gpu_bytes:
        return "gpu"
    if num_bytes <= cfg.host_bytes or cfg.materialize == "on":
        return "host"
    return None


@dataclass
class TableCounters:
    """What the table did, read by its metrics and ``GET /v1/graph`` (``GraphState``)."""

    build_s: float = 0.0
    rows_refreshed: int = 0
    rounds: int = 0
    full_recomputes: int = 0
    from_table: int = 0  # exact requests answered by a gather
    on_the_fly: int = 0  # exact requests that named a stale row
    last_staleness_s: float = 0.0
    failures: int = 0


class RefreshThread(Protocol):
    """The table's refresh thread as the table sees it (``table_refresh.Refresher``)."""

    busy: bool

    def wake(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...


@dataclass
class MarkSeeds:
    """What one step's applied records changed, noted for ``ExactTable.settle_marks``."""

    struct_nodes: np.ndarray
    feature_nodes: np.ndarray
    added: np.ndarray | None
    version: int
    sample_stream: torch.cuda.Stream | None


def union_of(parts: list[np.ndarray]) -> np.ndarray:
    """The sorted distinct ids of ``parts`` (int64; one part is returned as it is)."""
    parts = [p for p in parts if p.size]
    if not parts:
        return np.empty(0, np.int64)
    return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


class ExactTable:
    """Every layer's output for every node, on one engine core; see the module docstring."""

    def __init__(self, cfg: ExactConfig, model: LayerwiseModel, features: FeatureStore,
                 device: torch.device, capacity: int, where: str,
                 graph_of: Callable[[], CurrentGraph]) -> None:
        self.cfg, self.model, self.features = cfg, model, features
        self.device, self.capacity, self.where = device, int(capacity), where
        #: () -> CurrentGraph on ``device``: the graph as the engine core serves it now
        self.graph_of = graph_of
        store = device if where == "gpu" else torch.device("cpu")
        pin = where == "host" and device.type == "cuda"
        self.layers: list[Tensor] = [
            torch.zeros((self.capacity, d), dtype=torch.float32, device=store,
                        pin_memory=pin) for d in model.out_dims()]
        self.dim = int(self.layers[-1].shape[1])
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)
        self.on_gpu = device.type == "cuda"
        #: rows of the last layer that must not be served (host: read on every exact request)
        self.stale = np.ones(self.capacity, dtype=bool)
        self.saturated = False  # more than exact.full_recompute_fraction of the rows stale
        self.ready = False
        #: marks (engine thread) and round snapshots (refresh thread) take turns under this
        self.lock = threading.Lock()
        #: held while a chunk computes; the engine takes it to swap what chunks read (rebase)
        self.work_lock = threading.Lock()
        self.pending = [torch.zeros(self.capacity, dtype=torch.bool, device=device)
                        for _ in self.layers]
        self.pending_since_s: float | None = None  # accepted time of the oldest pending change
        #: marks noted by the engine loop and not propagated yet (``mark``, ``settle_marks``)
        self._seeds: deque[MarkSeeds] = deque()
        self._since_lock = threading.Lock()
        self.version = 0  # graph version every non-stale row is exact for (at least)
        self.marked_version = 0
        self.counters = TableCounters()
        #: chunks run on ``stream``; marks and round snapshots (under ``lock``) on ``mark_stream``,
        #: so a mark never waits behind a chunk
        self.stream = torch.cuda.Stream(device, priority=0) if self.on_gpu else None
        self.mark_stream = torch.cuda.Stream(device) if self.on_gpu else None
        self.serve_stream = torch.cuda.Stream(device, priority=-1) if self.on_gpu else None
        self._map = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.out_index: OutIndex | None = None
        self.refresher: RefreshThread | None = None

    # ---- computing rows ----------------------------------------------------------------------
    @contextlib.contextmanager
    def on_stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            yield

    def compute_rows(self, layer: int, targets: Tensor, graph: CurrentGraph) -> None:
        """Recompute ``layer``'s rows of ``targets`` (int64 on the device, sorted, unique)."""
        counts, src = graph.in_edges(targets)
        n_id, col = self._relabel(targets, src)
        dst = torch.repeat_interleave(torch.arange(targets.numel(), device=self.device), counts,
                                      output_size=src.numel())
        x = self.layer_input(layer, n_id)
        out = self.model.forward_layer(layer, x, torch.stack([col, dst]), int(targets.numel()),
                                       n_id)
        store = self.layers[layer]
        if store.device == out.device:
            store.index_copy_(0, targets, out)
        else:
            store.index_copy_(0, targets.cpu(), out.cpu())

    def _relabel(self, targets: Tensor, src: Tensor) -> tuple[Tensor, Tensor]:
        """Local ids: targets first (their order), then the other sources (ascending)."""
        m = self._map
        m[targets] = torch.arange(targets.numel(), device=self.device)
        others = torch.unique(src[m.index_select(0, src) < 0])
        m[others] = torch.arange(targets.numel(), targets.numel() + others.numel(),
                                 device=self.device)
        col = m.index_select(0, src)
        n_id = torch.cat([targets, others])
        m[n_id] = -1
        return n_id, col

    def layer_input(self, layer: int, n_id: Tensor) -> Tensor:
        """float32 rows ``layer`` reads for global ``n_id`` (on the device): the features for
        the first layer, the table's rows of the layer below for the others."""
        if layer == 0:
            return self.features.gather(n_id).to(self.device).float()
        store = self.layers[layer - 1]
        if store.device == n_id.device:
            return store.index_select(0, n_id)
        return store.index_select(0, n_id.cpu()).to(self.device, non_blocking=True)

    def chunks(self, targets: Tensor, graph: CurrentGraph,
               max_edges: int | None = None) -> list[Tensor]:
        """``targets`` split so that each chunk has at most ``max_edges`` (default
        ``exact.chunk_edges``) in-edges (a node with more is a chunk of its own)."""
        if targets.numel() == 0:
            return []
        return split_by_edges(targets, graph.in_degree(targets),
                              max_edges or self.cfg.chunk_edges, MAX_CHUNK_ROWS)

    # ---- building ------------------------------------------------------------------------------
    def build(self, progress: bool = True, yield_fraction: float = 0.0) -> None:
        """Every layer of every node, layer by layer (progress bar; time in the log).
        ``yield_fraction``: beside serving (a new model version's table), after each chunk the
        device and the interpreter are left to the serving loop for this fraction of the
        chunk's time."""
        from tqdm import tqdm

        if not hasattr(tqdm, "_lock"):
            # tqdm's default lock holds a multiprocessing semaphore, which leaks (and warns at
            # the daemon's exit) when this process is killed; a thread lock is all bars need
            tqdm.set_lock(threading.RLock())
        t0 = time.perf_counter()
        with self.work_lock, self.on_stream(self.stream):
            graph = self.graph_of()
            nodes = torch.arange(graph.num_nodes, device=self.device)
            pieces = self.chunks(nodes, graph)
            bar = tqdm(total=len(pieces) * len(self.layers), desc="exact table", unit="chunk",
                       disable=not progress, leave=False)
            for layer in range(len(self.layers)):
                for chunk in pieces:
                    t_chunk = time.perf_counter()
                    self.compute_rows(layer, chunk, graph)
                    bar.update()
                    if yield_fraction > 0:
                        if self.stream is not None:
                            self.stream.synchronize()
                        time.sleep((time.perf_counter() - t_chunk) * yield_fraction)
            bar.close()
            self._finish(graph, t0, "built")

    def restore(self, layers: list[np.ndarray]) -> None:
        """Every layer's rows from a snapshot of this table (``table_snapshot.py``) instead of
        computing them; the caller marks what changed since it was taken."""
        t0 = time.perf_counter()
        with self.work_lock, self.on_stream(self.stream):
            graph = self.graph_of()
            for mine, saved in zip(self.layers, layers, strict=True):
                rows = min(int(saved.shape[0]), self.capacity)
                mine[:rows].copy_(torch.from_numpy(np.ascontiguousarray(saved[:rows])),
                                  non_blocking=False)
            self._finish(graph, t0, "mapped from a snapshot")

    def finish_build(self, graph: CurrentGraph, started_s: float) -> None:
        """After every layer's rows of ``graph`` are computed beside serving (a new model
        version's table, ``table_build.py``): as ``build`` ends."""
        with self.work_lock, self.on_stream(self.stream):
            self._finish(graph, started_s, "built beside serving")

    def _finish(self, graph: CurrentGraph, t0: float, how: str) -> None:
        """The transposed index, a clean stale mask, ready (work lock held)."""
        self.out_index = OutIndex(graph, self.capacity,
                                  max(1 << 16, int(graph.indices.numel()) // 4))
        if self.stream is not None:
            self.stream.synchronize()
        self.stale = np.zeros(self.capacity, dtype=bool)
        self.stale[graph.num_nodes:] = True
        self.counters.build_s = time.perf_counter() - t0
        self.ready = True
        log.info("exact table: %d nodes x %s in %s memory (%.1f MiB), %s in %.2f s",
                 graph.num_nodes, [int(t.shape[1]) for t in self.layers], self.where,
                 self.nbytes / 2**20, how, self.counters.build_s)

    # ---- marking (engine thread, after a step's records are applied) ---------------------------
    def mark(self, struct_nodes: np.ndarray, feature_nodes: np.ndarray, added: np.ndarray | None,
             version: int, accepted_s: float,
             sample_stream: torch.cuda.Stream | None = None) -> None:
        """Mark what records up to ``version`` changed: ``struct_nodes`` (their in-lists),
        ``feature_nodes`` (their feature rows; nodes appended too), ``added`` (int64 [n, 2]
        edges added). The graph the engine serves already holds them. On a GPU the rows they
        reach are found later, beside the loop (``settle_marks``: at a round's start on the
        refresh thread, or before an exact request reads ``stale``); the loop only notes them."""
        if self.out_index is None:
            return
        self._seeds.append(MarkSeeds(struct_nodes, feature_nodes, added, version, sample_stream))
        if struct_nodes.size or feature_nodes.size:
            with self._since_lock:
                if self.pending_since_s is None:
                    self.pending_since_s = accepted_s
        if self.mark_stream is None:  # on the host the marks are found at once
            self.settle_marks()
        if self.refresher is not None:
            self.refresher.wake()

    def take_pending_since(self) -> float | None:
        """The accepted time of the oldest change not taken by a round yet, cleared."""
        with self._since_lock:
            since_s, self.pending_since_s = self.pending_since_s, None
            return since_s

    def settle_marks(self, held: bool = False) -> None:
        """Find the rows every mark so far reaches: ``pending`` per layer, ``stale`` and
        ``marked_version`` (``held``: the caller holds ``lock``). Always under ``lock``: a
        settle running on another thread has taken the seeds before it sets ``stale``, so an
        empty ``_seeds`` alone does not mean every mark is in ``stale`` yet."""
        if held:
            self._settle()
            return
        with self.lock:
            self._settle()

    def _settle(self) -> None:
        seeds: list[MarkSeeds] = []
        while self._seeds:
            seeds.append(self._seeds.popleft())
        if not seeds or self.out_index is None:
            return
        struct = union_of([m.struct_nodes for m in seeds])
        feature = union_of([m.feature_nodes for m in seeds])
        added = [m.added for m in seeds if m.added is not None and m.added.size]
        with self.on_stream(self.mark_stream):
            stream = seeds[-1].sample_stream
            if self.mark_stream is not None and stream is not None:
                self.mark_stream.wait_stream(stream)  # the device overlay's patches first
            if added:
                pairs = torch.from_numpy(np.ascontiguousarray(np.concatenate(added)))
                pairs = pairs.to(self.device)
                self.out_index.add_edges(pairs[:, 0], pairs[:, 1], self.graph_of())
            changed = self._propagate(struct, feature)  # reach of a union: union of reaches
            ids = torch.nonzero(changed).flatten().cpu().numpy()
        self.stale[ids] = True
        self.set_stale(self.stale)
        self.marked_version = seeds[-1].version

    def _propagate(self, struct_nodes: np.ndarray, feature_nodes: np.ndarray) -> Tensor:
        """OR each layer's changed rows into ``pending``; the last layer's, as a mask."""
        assert self.out_index is not None
        mask = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        if feature_nodes.size:
            mask[torch.from_numpy(feature_nodes).to(self.device)] = True
        struct = torch.zeros_like(mask)
        if struct_nodes.size:
            struct[torch.from_numpy(struct_nodes).to(self.device)] = True
            if self.model.degree_weighted:
                struct |= self.out_index.reach(struct)
        for layer in range(len(self.layers)):
            mask = mask | self.out_index.reach(mask) | struct
            self.pending[layer] |= mask
        return mask

    # ---- serving -------------------------------------------------------------------------------
    def waits(self) -> bool:
        """Whether a request naming a stale row waits for the refresh round (else it is
        computed on the fly): ``exact.stale_rows`` ``wait``, or ``auto`` while more than
        ``exact.full_recompute_fraction`` of the rows are stale (a full recompute is due, and
        on-the-fly answers would each cost about as much)."""
        policy = self.cfg.stale_rows
        if policy == "auto":
            self.settle_marks()
        return policy == "wait" or (policy == "auto" and self.saturated)

    def holds_updates(self) -> bool:
        """Whether a round runs that requests may wait for: while requests wait for it
        (``EngineCore.step`` checks that they do), the engine core applies no update, so the
        round ends with no stale row and they are answered before the next updates mark rows
        again. With no exact request waiting, updates apply during rounds."""
        return self.refresher is not None and self.refresher.busy and self.waits()

    def set_stale(self, stale: np.ndarray) -> None:
        """The stale mask (host), and whether it is over the full-recompute fraction."""
        self.stale = stale
        n = self.graph_of().num_nodes
        self.saturated = int(stale[:n].sum()) > self.cfg.full_recompute_fraction * n

    def servable(self, ids: np.ndarray) -> bool:
        self.settle_marks()
        return self.ready and not bool(self.stale[ids].any())

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 [n, dim]: the last layer's rows of ``ids`` (one gather, one copy)."""
        final = self.layers[-1]
        index = torch.from_numpy(ids)
        if final.device.type == "cpu":
            return final.index_select(0, index).numpy()
        assert self.serve_stream is not None
        with torch.cuda.stream(self.serve_stream):
            rows = final.index_select(0, index.to(self.device, non_blocking=True))
            host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(rows, non_blocking=True)
        self.serve_stream.synchronize()
        return host.numpy()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the refresh thread (waiting at most ``timeout_s`` for its chunk to end; 0: the
        thread ends on its own, the table's memory with it)."""
        if self.refresher is not None:
            self.refresher.stop(timeout_s)


class TableGraph:
    """The graph an engine core serves now, as its exact tables read it: on the device where
    the GPU sampler holds a copy, else the host's (a table on the GPU over a host graph reads
    one device copy of it, made once per base)."""

    def __init__(self, device: torch.device, static: tuple[Tensor, Tensor]) -> None:
        self.device, self.static = device, static
        #: (host indices it copies, device indptr, device indices), copied once per base
        self._copy: tuple[Tensor, Tensor, Tensor] | None = None

    def current(self, gpu: BaseSampler | None, overlay: Overlay | None,
                device_overlay: DeviceOverlay | None, num_nodes: int) -> CurrentGraph:
        """``overlay``/``device_overlay``: the living graph's (None: a fixed graph)."""
        dev_ptr = getattr(gpu, "indptr_device", None)  # a device-resident GPU sampler's CSC
        dev_idx = getattr(gpu, "indices_device", None)
        if self.device.type == "cuda" and dev_ptr is not None and dev_idx is not None \
                and dev_ptr.device.type == "cuda":
            view = device_overlay.view() if device_overlay is not None else None
            return CurrentGraph(dev_ptr, dev_idx, view, num_nodes)
        if overlay is not None:
            indptr, indices = torch.from_numpy(overlay.indptr), torch.from_numpy(overlay.indices)
            view = overlay.view()
        else:
            (indptr, indices), view = self.static, None
        graph = CurrentGraph(indptr, indices, view, num_nodes)
        if self.device.type == "cuda":  # a table on the GPU over a host graph
            return self._device_copy(graph, device_overlay, num_nodes)
        return graph

    def _device_copy(self, graph: CurrentGraph, device_overlay: DeviceOverlay | None,
                     num_nodes: int) -> CurrentGraph:
        cached = self._copy
        # the same host arrays (an overlay's base hands out a new tensor over them each call)
        if cached is None or cached[0].data_ptr() != graph.indices.data_ptr() \
                or cached[0].numel() != graph.indices.numel():
            cached = (graph.indices, graph.indptr.to(self.device), graph.indices.to(
                self.device, torch.int32 if num_nodes < 2 ** 31 else torch.int64))
            self._copy = cached
        view = graph.view
        if view is not None:
            view = device_overlay.view() if device_overlay is not None else None
        return CurrentGraph(cached[1], cached[2], view, graph.num_nodes)


def new_exact_table(cfg: ExactConfig, served: ServedModel, features: FeatureStore,
                    device: torch.device, capacity: int, graph_of: Callable[[], CurrentGraph],
                    progress: bool = True, yield_fraction: float = 0.0,
                    restore: list[np.ndarray] | None = None,
                    build: bool = True) -> ExactTable | None:
    """An exact table of ``served`` over the graph ``graph_of()`` returns, built (or its rows
    taken from ``restore``, a snapshot's layers; with ``build`` False, neither: the caller
    computes its rows, ``table_build.py``; no refresh thread yet); None when the config
    or the model says no (logged). The graph must not change
    while it builds (start-up, or updates held: ``model_load.py``)."""
    if cfg.materialize == "off":
        return None
    why = unsupported(served)
    if why is not None:
        if cfg.materialize == "on":
            raise ValueError(f"exact.materialize=on but {why}")
        log.info("exact table off: %s", why)
        return None
    model = LayerwiseModel(served)
    num_bytes = table_bytes(capacity, model.out_dims())
    where = placement(cfg, device, num_bytes)
    if where is None:
        log.info("exact table off: %.1f MiB exceeds exact.gpu_bytes and exact.host_bytes",
                 num_bytes / 2**20)
        return None
    table = ExactTable(cfg, model, features, device, capacity, where, graph_of)
    if restore is not None:
        table.restore(restore)
    elif build:
        table.build(progress, yield_fraction)
    return table
