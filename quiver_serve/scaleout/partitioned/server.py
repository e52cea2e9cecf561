"""A partition server: one Ray actor per partition and replica, holding what the partition's
snapshot folder holds (``quiver_serve/partition/``: its nodes' in-edge lists, their features, the
hot rows of other partitions) mapped from disk, and the served model on its GPU or the CPU.

``embed`` runs a request's ids through the pipeline of docs/architecture.md ("Partitioned
serving"): the partition-aware sampler (``sampling.py``: its own hops here, the other partitions'
by one call per partition per hop), the partition-aware feature source (``features.py``) and the
model (``models/served.py``, the engine core's). ``sample_hop`` and ``rows`` answer the other
partition servers. Its living graph (updates, version waits, the log's compaction) is
``server_living.py``. Why this is not the engine core with two seams, and what that costs, is
decision 0044. Every answer that is not rows is a plain dict ``{code, message, status}``
(exceptions would lose their status on the way through Ray).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.devices import worker_device
from quiver_serve.features.build import DTYPES
from quiver_serve.models.layerwise import LayerwiseModel
from quiver_serve.models.served import ServedModel, build_model
from quiver_serve.models.startup import start_plan
from quiver_serve.partition.data import load_partition
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.scaleout.partitioned.batching import Coalescer
from quiver_serve.scaleout.partitioned.compaction import Moves, grown_book, serving_base
from quiver_serve.scaleout.partitioned.features import PartitionFeatures, RidingRows
from quiver_serve.scaleout.partitioned.links import WireService
from quiver_serve.scaleout.partitioned.live import log_folder
from quiver_serve.scaleout.partitioned.peers import PartitionUnavailable, Peers, PeerSettings
from quiver_serve.scaleout.partitioned.sampling import (
    LocalGraph,
    PartitionSampler,
    VirtualNodes,
    as_tensor,
    local_hop,
    off_loop,
)
from quiver_serve.scaleout.partitioned.server_living import (
    MARK_MARGIN_S,
    LivingPartition,
    refusal,
)
from quiver_serve.scaleout.partitioned.table import OutEdges, PartitionTable, TableSources
from quiver_serve.scaleout.partitioned.table_marks import MarkGroups, as_answer, link_targets

log = logging.getLogger(__name__)
#: tries of a started primary to mark what it replayed (a second apart)
REMARK_ATTEMPTS = 120


@dataclass(frozen=True)
class ServerArgs:
    """Which partition and replica a server is, and where its snapshot folder is."""

    app: str
    data_dir: str
    part: int
    replica: int
    replicas: int


class PartitionServer(LivingPartition):
    """See the module docstring; Ray makes it an actor (``deploy.py``)."""

    def __init__(self, cfg_dict: dict[str, Any], args: ServerArgs,
                 degrees: dict[str, Any] | None = None) -> None:
        self.cfg = cfg = ServeConfig.model_validate(cfg_dict)
        self.args = args
        torch.set_num_threads(cfg.inference.torch_threads)
        sys.setswitchinterval(cfg.inference.switch_interval_ms / 1e3)  # decision 0058
        data = load_partition(Path(args.data_dir), args.part, mmap=True)
        folder = log_folder(Path(args.data_dir), cfg.graph.update_log_dir, args.part)
        base = serving_base(folder, data)  # the snapshot, or the newest base of its log
        book = grown_book(Path(args.data_dir), base.entries) if base.entries else data.book
        self.num_nodes, self.num_parts = int(book.num_nodes), int(book.num_parts)
        self.owned, self.edges = int(base.features.shape[0]), int(base.indices.size)
        owner, local = as_tensor(book.owner), as_tensor(book.local)
        pc = cfg.partitioned
        self.peers = Peers(args.part, PeerSettings(
            app=args.app, num_parts=self.num_parts, replicas=args.replicas,
            timeout_s=pc.remote_timeout_s, delay_s=pc.transport_delay_ms / 1e3,
            transport=pc.transport, down_s=pc.down_s))
        self.wire = WireService(self._answer_wire)
        self.graph = LocalGraph(args.part, owner, local, as_tensor(base.indptr),
                                as_tensor(base.indices))
        self.sampler = PartitionSampler(self.graph, self.num_parts, self.peers.sample_hop)
        self.features = PartitionFeatures(
            args.part, owner, local, as_tensor(base.features), as_tensor(data.hot_ids),
            as_tensor(data.hot_features), self.num_parts, self.peers.rows)
        #: the own rows of the base in force, in host memory (what a compaction folds)
        self.base_x = base.features
        self.moves = Moves()
        #: the hot ids of the other partitions (``peer_hot``), read at their first call
        self._peer_hot: dict[int, np.ndarray] = {}
        self.table: PartitionTable | None = None  # built once the model is (``_table``)
        self.table_wanted, self.marking, self._remarked = False, set(), False
        self.mark_groups = MarkGroups(self.mark_all)
        self.mark_targets = lambda: link_targets(
            self.peers, (args.part, args.replica), self.mark_here,
            cfg.partitioned.remote_timeout_s + MARK_MARGIN_S)
        self.live = self._open_live(folder, book, base)
        self.device = worker_device(cfg, 0)
        self.device_bytes = self._place()
        self.model, self.fanouts = self._model(int(data.features.shape[1]), degrees)
        self.table = self._table()
        self.storage_dtype = DTYPES[cfg.features.storage_dtype]
        self.ongoing, self.requests, self.refused = 0, 0, 0
        self.batches = Coalescer(lambda ids: self._embed(ids, False, None),
                                 cfg.batching.max_batch_nodes)
        #: exact requests merge with each other, as in the engine core (no draws: an exact
        #: row does not depend on the batch)
        self.exact_batches = Coalescer(lambda ids: self._embed(ids, True, None),
                                       cfg.batching.max_batch_nodes)
        log.info("partition %d replica %d: %d nodes, %d in-edges, %d hot rows on %s (%d bytes "
                 "of them on it)", args.part, args.replica, self.owned, self.edges,
                 data.hot_ids.size, self.device, self.device_bytes)

    def _place(self) -> int:
        """The in-edge lists, then the hot rows, then the own rows on this server's GPU while
        they fit in ``partitioned.device_bytes`` (decision 0054); the bytes placed."""
        budget = self.cfg.partitioned.device_bytes
        placed = self.graph.place(self.device, budget)
        return placed + self.features.place(self.device, budget - placed)

    def _model(self, in_channels: int, degrees: dict[str, Any] | None,
               ) -> tuple[ServedModel, list[int]]:
        """The primary model as the engine core builds it (weights-only), on this device; a
        GCN gets the whole graph's in-degrees (``degrees``) for exact mode."""
        import ray

        spec = start_plan(self.cfg).primary()
        in_degree = self_loops = None
        if degrees is not None:
            arrays = ray.get(degrees["ref"]) if "ref" in degrees else degrees
            in_degree = as_tensor(arrays["in_degree"])
            self_loops = as_tensor(arrays["self_loops"]) if spec.pyg_class == "GCN" else None
        inf = self.cfg.inference
        model = ServedModel(build_model(spec, in_channels), in_degree, self_loops,
                            precision=inf.precision, fast=inf.fast_model).to(self.device)
        return model, spec.fanouts_or(self.cfg.sampling.fanouts)

    def _table(self) -> PartitionTable | None:
        """The exact table of the own rows (``table.py``) when ``exact.materialize`` is on, or
        auto and it fits ``exact.gpu_bytes`` (on a GPU server) or ``exact.host_bytes``."""
        ecfg = self.cfg.exact
        if ecfg.materialize == "off":
            return None
        try:
            layerwise = LayerwiseModel(self.model)
        except ValueError as exc:
            log.info("partition %d: no exact table: %s", self.args.part, exc)
            return None
        self.table_wanted = True  # the others hold tables alike: this one's updates mark them
        nbytes = self.owned * sum(layerwise.out_dims()) * 4
        device = self.device if self.device.type != "cpu" and nbytes <= ecfg.gpu_bytes \
            else torch.device("cpu")
        if ecfg.materialize == "auto" and device.type == "cpu" and nbytes > ecfg.host_bytes:
            log.info("partition %d: no exact table: %d bytes past exact.host_bytes",
                     self.args.part, nbytes)
            return None
        table = PartitionTable(ecfg, layerwise, self.args.part, device, self.peers.table_rows)
        table.follow_book(self.graph.owner, self.graph.local)
        table.rebase(OutEdges.of_base(self.graph.indptr, self.graph.indices))
        return table

    def _start_table(self) -> None:
        """The table's refresh loop, on the running loop (started by ``info``, an exact
        request or a mark, whichever comes first after a start)."""
        if self.table is None:
            return

        self.table.start(self._table_sources())
        if self.live.log is not None and not self._remarked:
            self._remarked = True
            asyncio.ensure_future(self._mark_replayed())

    def _table_sources(self) -> TableSources:
        async def follow() -> None:
            await self._current(lambda: asyncio.sleep(0))

        return TableSources(lambda: self.graph, self.features.gather, follow)

    async def _mark_replayed(self) -> None:
        """A started primary marks what its log holds past its base (an update applied before
        a crash may not have been marked; ``table_marks.py``), until every server took it."""
        assert self.table is not None
        own = self.table.own_ids
        written = np.fromiter(self.live.rows_written, np.int64, len(self.live.rows_written))
        changed = own[torch.from_numpy(written[written < own.numel()])].numpy()
        lists = own[torch.from_numpy(self.live.overlay.changed_nodes())].numpy()
        if changed.size == 0 and lists.size == 0:
            return
        for attempt in range(REMARK_ATTEMPTS):
            try:
                await self.mark_rows(changed, lists, self.live.version)
                return
            except Exception:  # noqa: BLE001 - retried; peers may still be starting
                log.exception("partition %d: marking the replayed updates failed (attempt %d)",
                              self.args.part, attempt + 1)
                await asyncio.sleep(1.0)

    # ---- answering the ingress ---------------------------------------------------------------
    async def embed(self, node_ids: np.ndarray, exact: bool, seed: int | None,
                    timeout_s: float | None) -> np.ndarray | dict[str, Any]:
        """float32 rows of global ``node_ids`` (the subgraph drawn with ``seed``, or a fresh
        batch seed; every neighbour per hop when ``exact``), or a refusal: 503 with the
        partition that did not answer, 503 overloaded, 504 past ``timeout_s``."""
        def work() -> Awaitable[np.ndarray]:
            if exact and self.table is not None:
                return self._exact(node_ids)
            return self.exact_batches.submit(node_ids) if exact else \
                self.batches.submit(node_ids) if seed is None else \
                self._embed(node_ids, exact, seed)

        return await self._admitted(work, timeout_s, "embed")

    async def _exact(self, node_ids: np.ndarray) -> np.ndarray:
        """Exact rows of ``node_ids``: the table's fresh rows, the others on the fly."""
        assert self.table is not None
        self._start_table()  # a restarted server starts its loop at its first call
        ids = torch.from_numpy(np.ascontiguousarray(node_ids, np.int64))
        rows = self.table.own_rows_of(ids)
        if rows.numel() != ids.numel():  # not all owned here: the ingress sends owners theirs
            return await self.exact_batches.submit(node_ids)
        stale = self.table.stale_of(rows)
        out = self.table.lookup(rows, ~stale)
        if bool(stale.any()):
            out[stale.numpy()] = await self.exact_batches.submit(ids[stale].numpy())
        return out

    async def embed_new(self, node_ids: np.ndarray, exact: bool, seed: int | None,
                        timeout_s: float | None, features: np.ndarray, offsets: np.ndarray,
                        neighbors: np.ndarray) -> np.ndarray | dict[str, Any]:
        """``embed`` of ``node_ids`` and of a request's own new nodes (inductive: feature rows
        and in-neighbours as CSR ``offsets``/``neighbors``, checked by the ingress), whose rows
        follow; they take the next free ids and run alone. A GCN is refused (its exact norm
        uses the snapshot's in-degrees)."""
        if self.model.gcn_norm is not None:
            return refusal(errors.ServeError("unsupported_on_ray", "a request's own new_nodes "
                                             "are not supported on a partitioned graph serving "
                                             "a GCN", 400))

        def work() -> Awaitable[np.ndarray]:
            feats = np.asarray(features, np.float32)
            if feats.ndim != 2 or feats.shape[1] != self.features.dim:
                raise errors.ServeError("invalid_new_nodes", f"new_nodes[].features must have "
                                        f"{self.features.dim} numbers each", 422)
            virtual = VirtualNodes(self.num_nodes, torch.from_numpy(np.asarray(offsets, np.int64)),
                                   torch.from_numpy(np.asarray(neighbors, np.int64)),
                                   torch.from_numpy(feats))
            if virtual.neighbors.numel():
                errors.check_id_range(virtual.neighbors.numpy(), self.num_nodes)
            if exact and self.table is not None:
                return self._exact_new(np.asarray(node_ids, np.int64), virtual)
            ids = np.concatenate([np.asarray(node_ids, np.int64),
                                  np.arange(virtual.first, virtual.first + virtual.count)])
            return self._embed(ids, exact, seed, virtual)

        return await self._admitted(work, timeout_s, "embed_new")

    async def _exact_new(self, node_ids: np.ndarray, virtual: VirtualNodes) -> np.ndarray:
        """Exact rows of ``node_ids`` and then of a request's own new nodes from the tables
        (``PartitionTable.inductive``); the whole request on the fly when a row it reads is
        stale."""
        assert self.table is not None
        self._start_table()
        new = await self.table.inductive(virtual.features, virtual.indptr, virtual.neighbors,
                                         self._table_sources())
        if new is None:
            ids = np.concatenate([node_ids, np.arange(virtual.first,
                                                      virtual.first + virtual.count)])
            return await self._embed(ids, True, None, virtual)
        old = await self._exact(node_ids) if node_ids.size else \
            np.empty((0, self.model.out_dim), np.float32)
        return np.concatenate([old, np.ascontiguousarray(new.cpu().numpy(), np.float32)])

    async def _admitted(self, work: Callable[[], Awaitable[np.ndarray]], timeout_s: float | None,
                        what: str) -> np.ndarray | dict[str, Any]:
        """``work()``'s rows within ``timeout_s`` (the server's default when None) and the
        ongoing-request limit, or the refusal (module docstring)."""
        if self.ongoing >= self.cfg.partitioned.max_ongoing_requests:
            self.refused += 1
            return refusal(errors.overloaded("the partition server is at its ongoing-request "
                                             "limit; retry later"))
        timeout_s = self.cfg.server.request_timeout_s if timeout_s is None else timeout_s
        self.ongoing += 1
        self.requests += 1
        try:
            return await asyncio.wait_for(self._current(work), timeout_s)
        except PartitionUnavailable as exc:
            return {**refusal(errors.unavailable("partition_unavailable", str(exc))),
                    "partition": exc.part}
        except errors.ServeError as exc:
            return refusal(exc)
        except asyncio.TimeoutError:
            return refusal(errors.deadline())
        except Exception as exc:  # noqa: BLE001 - a fault: a 500 naming an id in the log
            return refusal(errors.internal_error(exc, f"partition {self.args.part} {what}", log))
        finally:
            self.ongoing -= 1

    async def _embed(self, node_ids: np.ndarray, exact: bool, seed: int | None,
                     virtual: VirtualNodes | None = None) -> np.ndarray:
        ids = torch.from_numpy(np.ascontiguousarray(node_ids, np.int64))
        fanouts = [-1] * len(self.fanouts) if exact else self.fanouts
        riding = RidingRows(self.features) \
            if ids.numel() <= self.cfg.partitioned.rows_ride_max_seeds else None
        try:
            sampled = await self.sampler.sample(ids, fanouts, new_batch_seed() if seed is None
                                                else seed, virtual, riding)
            if virtual is None:
                x = await self.features.gather(sampled.n_id, riding)
            else:  # the virtual nodes' rows are the request's
                real = sampled.n_id < virtual.first
                x = torch.empty((sampled.n_id.numel(), self.features.dim),
                                dtype=torch.float32, device=self.features.device)
                x[real.to(x.device)] = await self.features.gather(sampled.n_id[real], riding)
                x[(~real).to(x.device)] = virtual.features[
                    sampled.n_id[~real] - virtual.first].to(x.device)
        finally:
            if riding is not None:
                riding.close()
        return await asyncio.to_thread(self.forward, x, sampled, exact)

    def forward(self, x: Tensor, sampled: Any, exact: bool) -> np.ndarray:
        """The model over a gathered batch on this server's device: float32 rows of its seeds."""
        dev = self.device
        out = self.model(x.to(dev, self.storage_dtype), sampled.n_id.to(dev), sampled.edge_index.to(dev),
                         sampled.num_sampled_nodes, sampled.num_sampled_edges, exact)
        rows = out.index_select(0, sampled.seed_index.to(dev)).float()
        return np.ascontiguousarray(rows.cpu().numpy())

    # ---- answering the other partition servers -------------------------------------------------
    async def sample_hop(self, ids: np.ndarray, k: int, hop: int, base: int,
                         rows_for: int = -1, last: bool = False,
                         ) -> tuple[np.ndarray, ...] | dict[str, Any]:
        """Hop ``hop`` of the global ``ids`` this partition owns: (neighbours, count per id);
        with ``rows_for`` (the calling partition) also (row ids, rows): the feature rows its
        gather will want from here, those of ``ids`` and, at the ``last`` hop, of the drawn
        neighbours owned here, less the rows it replicates (decision 0070)."""
        return await self._current(lambda: off_loop(self._hop, int(np.size(ids)), ids, k, hop,
                                                    base, rows_for, last))

    def _hop(self, ids: np.ndarray, k: int, hop: int, base: int, rows_for: int = -1,
             last: bool = False) -> tuple[np.ndarray, ...] | dict[str, Any]:
        try:
            nbr, count = local_hop(self.graph, torch.from_numpy(np.asarray(ids, np.int64)), k,
                                   hop, base)
        except ValueError as exc:
            return {"code": "not_owned", "message": str(exc), "status": 400}
        if rows_for < 0:
            return nbr.numpy(), count.numpy()
        want = np.asarray(ids, np.int64)
        if last:
            owned = nbr[self.graph.owner[nbr].to(torch.int64) == self.args.part]
            want = np.concatenate([want, owned.numpy()])
        want = np.unique(want)
        hot = self.peer_hot(int(rows_for))
        if hot.size:  # sorted: a binary search per row, not a sort of the hot set per call
            at = np.minimum(np.searchsorted(hot, want), hot.size - 1)
            want = want[hot[at] != want]
        return nbr.numpy(), count.numpy(), want, self.features.own_rows(want)

    def peer_hot(self, part: int) -> np.ndarray:
        """The sorted global ids partition ``part`` replicates (its snapshot's hot rows; empty
        when its folder is not on this host: then every row rides)."""
        if part not in self._peer_hot:
            try:
                hot = load_partition(Path(self.args.data_dir), part, mmap=True).hot_ids
                self._peer_hot[part] = np.asarray(hot, np.int64)
            except (OSError, ValueError):
                self._peer_hot[part] = np.empty(0, np.int64)
        return self._peer_hot[part]

    async def rows(self, ids: np.ndarray) -> np.ndarray | dict[str, Any]:
        """Feature rows of the global ``ids`` this partition owns."""
        return await self._current(lambda: off_loop(self._rows, int(np.size(ids)), ids))

    def _rows(self, ids: np.ndarray) -> np.ndarray | dict[str, Any]:
        try:
            return self.features.own_rows(ids)
        except ValueError as exc:
            return {"code": "not_owned", "message": str(exc), "status": 400}

    async def table_rows(self, ids: np.ndarray, layer: int,
                         ) -> tuple[np.ndarray, np.ndarray] | dict[str, Any]:
        """Layer ``layer``'s exact-table rows of the global ``ids`` this partition owns, and
        their stale flags (a peer's table reads them as its next layer's input)."""
        async def work() -> tuple[np.ndarray, np.ndarray] | dict[str, Any]:
            table = self.table
            if table is None or not 0 <= int(layer) < table.num_layers:
                return {"code": "no_table", "message": f"partition {self.args.part} holds no "
                        f"exact table of layer {layer}", "status": 400}
            rows = table.own_rows_of(torch.from_numpy(np.asarray(ids, np.int64)))
            if rows.numel() != np.size(ids):
                return {"code": "not_owned", "message": "ids of another partition", "status": 400}
            return table.layer_rows(int(layer), rows)

        return await self._current(work)

    async def table_mark(self, changed: np.ndarray, layer: int, every: bool,
                         lists: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Mark the table's rows of ``layer`` an update can change (``table_marks.py``; the
        update's primary calls every server, layer by layer, before it answers): from the
        global ids ``changed`` (every node when ``every``) and ``lists`` (in-lists changed).
        Answers the global ids marked and [the model's layers (0: no table here), whether every
        own row was marked]."""
        async def work() -> tuple[np.ndarray, np.ndarray]:
            table = self.table
            if table is None:
                return np.empty(0, np.int64), np.zeros(2, np.int64)
            self._start_table()
            got = table.mark(int(layer), None if every else
                             torch.from_numpy(np.asarray(changed, np.int64)),
                             torch.as_tensor(np.asarray(lists, np.int64).reshape(-1)),
                             self.live.added_edges(), self.num_nodes)
            ids = np.empty(0, np.int64) if got is None else got.numpy()
            return ids, np.array([table.num_layers, got is None], np.int64)

        return await self._current(work)

    async def mark_here(self, layer: int, changed: np.ndarray | None,
                        lists: np.ndarray) -> dict[str, Any]:
        """``table_mark`` of this server, called in place by its own updates' marks."""
        ids = np.empty(0, np.int64) if changed is None else changed
        return as_answer(*await self.table_mark(ids, layer, changed is None, lists.tolist()))

    async def _answer_wire(self, method: str, ids: np.ndarray, args: list[Any]) -> Any:
        if method == "embed":  # the ingress (decision 0054)
            exact, seed, timeout_s = args
            return await self.embed(ids, bool(exact), seed, timeout_s)
        if method == "sample_hop":  # followed on the loop; the work may go to a thread
            return await self.sample_hop(ids, *args)
        if method == "table_rows":
            return await self.table_rows(ids, *args)
        if method == "table_mark":
            return await self.table_mark(ids, *args)
        return await self.rows(ids)

    async def wire_address(self) -> str:
        """Where this server answers peers over the wire (bound on the first ask)."""
        import ray

        return self.wire.start(ray.util.get_node_ip_address())

    # ---- status -------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """What ``GET /v1/graph`` and ``/metrics`` show of this server (the wire's address
        bound first, so peers find it ready)."""
        if self.cfg.partitioned.transport == "wire":
            await self.wire_address()
        self._follow()
        self._start_table()
        counts = self.features.counts
        return {"partition": self.args.part, "replica": self.args.replica, "pid": os.getpid(),
                "nodes": self.owned, "graph_nodes": self.num_nodes, "edges": self.edges,
                "device": str(self.device),
                "dim": self.model.out_dim, "features": self.features.dim,
                "requests": self.requests, "refused": self.refused, "ongoing": self.ongoing,
                "batches": self.batches.batches + self.exact_batches.batches,
                "transport": self.peers.settings.transport,
                "rows": {"local": counts.local, "hot": counts.hot, "remote": counts.remote,
                         "riding": counts.riding, "late_calls": counts.late_calls},
                "hot_hit_rate": counts.hot_hit_rate(), "calls": self.peers.snapshot(),
                "version": self.graph_version(), "base_version": self.live.base_version,
                "overlay": self.live.overlay.usage(), "compaction": self.moves.snapshot(),
                "table": None if self.table is None else self.table.snapshot(),
                "time_s": time.time()}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Release the partition's log, the wire's port and the links to peers (a server
        started again in this process takes them)."""
        super().close()
        if self.table is not None:
            self.table.stop()
        self.wire.close()
        self.peers.link.close()

