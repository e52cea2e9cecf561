"""A partition server: one Ray actor per partition and replica, holding what the partition's
snapshot folder holds (``quiver_serve/partition/``: its nodes' in-edge lists, their features, the
hot rows of other partitions) mapped from disk, and the served model on its GPU or the CPU.

``embed`` runs a request's ids through the pipeline of docs/architecture.md ("Partitioned
serving"): the partition-aware sampler (``sampling.py``: its own hops here, the other partitions'
by one call per partition per hop), the partition-aware feature source (``features.py``) and the
model (``models/served.py``, the engine core's). ``sample_hop`` and ``rows`` answer the other
partition servers. Why this is not the engine core with two seams, and what that costs, is
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
from quiver_serve.models.served import ServedModel, build_model
from quiver_serve.models.startup import start_plan
from quiver_serve.partition.data import load_partition
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.scaleout.partitioned.batching import Coalescer
from quiver_serve.scaleout.partitioned.compaction import (
    BASE_CHECK_S,
    Moves,
    ServingBase,
    base_in_force,
    base_meta,
    fold,
    grown_book,
    serving_base,
)
from quiver_serve.scaleout.partitioned.features import PartitionFeatures
from quiver_serve.scaleout.partitioned.links import WireService
from quiver_serve.scaleout.partitioned.live import (
    LiveBase,
    PartitionLive,
    load_dropped,
    log_folder,
    save_dropped,
)
from quiver_serve.scaleout.partitioned.peers import PartitionUnavailable, Peers, PeerSettings
from quiver_serve.scaleout.partitioned.sampling import (
    LocalGraph,
    PartitionSampler,
    VirtualNodes,
    as_tensor,
    local_hop,
    off_loop,
)

log = logging.getLogger(__name__)


def refusal(exc: errors.ServeError) -> dict[str, Any]:
    return {"code": exc.info.code, "message": exc.info.message, "status": exc.info.status}


@dataclass(frozen=True)
class ServerArgs:
    """Which partition and replica a server is, and where its snapshot folder is."""

    app: str
    data_dir: str
    part: int
    replica: int
    replicas: int


class PartitionServer:
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
        self.live = self._open_live(folder, book, base)
        self.device = worker_device(cfg, 0)
        self.device_bytes = self._place()
        self.model, self.fanouts = self._model(int(data.features.shape[1]), degrees)
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

    def _open_live(self, folder: Path, book: Any, base: ServingBase) -> PartitionLive:
        """The partition's living graph over its update log, replayed after ``base``: replica
        0 writes the log, the others follow it (decision 0053); its written rows and dropped
        hot copies shown to the feature source, its grown book and overlay to the sampler."""
        live = PartitionLive(folder, self.cfg.graph, self.args.part, book, self.graph.indptr,
                             self.graph.indices, self.features.dim,
                             follow=self.args.replica != 0,
                             base=LiveBase(base.version, base.entries))
        self.features.written = live.written
        self.features.drop_hot(load_dropped(folder))
        self.live = live
        self._refresh()
        log.info("partition %d replica %d: %d updates replayed from %s over the base of version "
                 "%d (version %d)", self.args.part, self.args.replica, live.replayed, folder,
                 base.version, live.version)
        return live

    def _refresh(self, moved: bool = False) -> None:
        """Show the living graph's state to the sampler and the feature source: the grown
        book's owner and local rows (always after a move: a new book), the overlay's view."""
        live = self.live
        if moved or self.graph.owner.numel() != live.owner.numel():
            self.graph.owner, self.graph.local = live.owner, live.local
            self.features.grow(live.owner, live.local)
            self.num_nodes = int(live.owner.numel())
        self.graph.overlay = live.view()

    def _follow(self) -> None:
        """A replica other than 0 applies what its partition's primary logged since its last
        read, before it reads (one ``fstat`` when nothing is new; decision 0053), and moves to
        a newer base its primary wrote (``compaction.py``). On the event loop only."""
        live = self.live
        if live.follower is None:
            return
        if live.catch_up():
            self._refresh()
        now = time.monotonic()
        if self.moves.running is None and (live.stalled or now >= self.moves.checked_s
                                           + BASE_CHECK_S):
            self.moves.checked_s = now
            if base_in_force(live.directory) > live.base_version:
                self.moves.start(self._move_to_newest())

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

    # ---- answering the ingress ---------------------------------------------------------------
    async def embed(self, node_ids: np.ndarray, exact: bool, seed: int | None,
                    timeout_s: float | None) -> np.ndarray | dict[str, Any]:
        """float32 rows of global ``node_ids`` (the subgraph drawn with ``seed``, or a fresh
        batch seed; every neighbour per hop when ``exact``), or a refusal: 503 with the
        partition that did not answer, 503 overloaded, 504 past ``timeout_s``."""
        def work() -> Awaitable[np.ndarray]:
            return self.exact_batches.submit(node_ids) if exact else \
                self.batches.submit(node_ids) if seed is None else \
                self._embed(node_ids, exact, seed)

        return await self._admitted(work, timeout_s, "embed")

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
            ids = np.concatenate([np.asarray(node_ids, np.int64),
                                  np.arange(virtual.first, virtual.first + virtual.count)])
            return self._embed(ids, exact, seed, virtual)

        return await self._admitted(work, timeout_s, "embed_new")

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
            self._follow()
            return await asyncio.wait_for(work(), timeout_s)
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
        sampled = await self.sampler.sample(ids, fanouts, new_batch_seed() if seed is None
                                            else seed, virtual)
        if virtual is None:
            x = await self.features.gather(sampled.n_id)
        else:  # the virtual nodes' rows are the request's
            real = sampled.n_id < virtual.first
            x = torch.empty((sampled.n_id.numel(), self.features.dim), dtype=torch.float32,
                            device=self.features.device)
            x[real.to(x.device)] = await self.features.gather(sampled.n_id[real])
            x[(~real).to(x.device)] = virtual.features[sampled.n_id[~real] - virtual.first].to(
                x.device)
        return await asyncio.to_thread(self.forward, x, sampled, exact)

    def forward(self, x: Tensor, sampled: Any, exact: bool) -> np.ndarray:
        """The model over a gathered batch on this server's device: float32 rows of its seeds."""
        dev = self.device
        out = self.model(x.to(dev, self.storage_dtype), sampled.n_id.to(dev), sampled.edge_index.to(dev),
                         sampled.num_sampled_nodes, sampled.num_sampled_edges, exact)
        rows = out.index_select(0, sampled.seed_index.to(dev)).float()
        return np.ascontiguousarray(rows.cpu().numpy())

    # ---- the living graph (``live.py``) ------------------------------------------------------------
    def update(self, kind: str, first: Any, second: Any) -> dict[str, Any]:
        """``edges`` (add, remove) or ``features`` (node_ids, rows) of nodes this partition
        owns, or ``nodes`` (``first``: [first id, count, owner], ``second``: their rows at the
        owner): the durable version's answer, or a refusal. Replica 0 only (it writes the log)."""
        if kind in ("edges", "nodes") and self.model.gcn_norm is not None:
            return refusal(errors.ServeError(
                "unsupported_on_ray", f"{kind} updates are not supported on a partitioned graph "
                "serving a GCN: its exact mode uses the in-degrees of the snapshot", 400))
        try:
            if kind == "edges":
                out = self.live.add_edges(first, second)
            elif kind == "nodes":
                out = self.live.add_nodes(*(int(v) for v in first), second)
            else:
                out = self.live.put_features(first, second)
            self._refresh()
            if self.live.wants_compaction():
                self._start_compaction()
            return out
        except errors.ServeError as exc:
            if exc.info.code == "overlay_full":
                self._start_compaction()
            return refusal(exc)
        except Exception as exc:  # noqa: BLE001 - a fault: a 500 naming an id in the log
            return refusal(errors.internal_error(exc, f"partition {self.args.part} update", log))

    # ---- compaction (``compaction.py``) -------------------------------------------------------
    async def compact(self) -> dict[str, Any]:
        """Fold this partition's updates into a new base now (replica 0; ``POST
        /v1/graph/compact``): ``{version, compacted, ...}`` once it serves from it."""
        if self.live.log is None:
            return refusal(errors.ServeError("not_primary", f"partition {self.args.part}: "
                                             "replica 0 compacts its log", 400))
        if self.moves.running is not None:
            await asyncio.shield(self.moves.running)
        return await self._start_compaction()

    def _start_compaction(self) -> asyncio.Future[Any]:
        running = self.moves.running
        return running if running is not None else self.moves.start(self._compact())

    async def _compact(self) -> dict[str, Any]:
        """The fold (beside the loop, on a frozen overlay), the base written, the move."""
        live, t0 = self.live, time.perf_counter()
        version = live.version
        if version == live.base_version:
            return {"version": version, "compacted": False, "reason": "nothing new"}
        frozen = live.overlay.freeze()
        written, entries = dict(live.rows_written), [list(e) for e in live.entries]
        try:
            arrays = await asyncio.to_thread(fold, frozen, self.base_x, written, entries,
                                             self.num_nodes)
        finally:
            live.overlay.thaw()
        assert live.log is not None
        await asyncio.to_thread(live.log.write_base, version, arrays,
                                base_meta(self.args.part, self.num_parts, version))
        del arrays
        await self._move_to_newest()
        seconds = time.perf_counter() - t0
        self.moves.compactions += 1
        self.moves.last_compaction_s = seconds
        log.info("partition %d: compacted at version %d in %.2f s", self.args.part, version,
                 seconds)
        return {"version": version, "compacted": True, "duration_s": round(seconds, 3)}

    async def _move_to_newest(self) -> None:
        """Serve from the newest base of the log: built beside the loop (mapped, the records
        after it replayed, placed on the device), then the last records and the swap on it."""
        old, args = self.live, self.args

        def build() -> tuple[PartitionLive, LocalGraph, Any, ServingBase]:
            data = load_partition(Path(args.data_dir), args.part, mmap=True)
            base = serving_base(old.directory, data)
            book = grown_book(Path(args.data_dir), base.entries)
            graph = LocalGraph(args.part, as_tensor(book.owner), as_tensor(book.local),
                               as_tensor(base.indptr), as_tensor(base.indices))
            live = PartitionLive(old.directory, self.cfg.graph, args.part, book, graph.indptr,
                                 graph.indices, self.features.dim, follow=old.log is None,
                                 base=LiveBase(base.version, base.entries, old.log))
            if live.log is not None:
                live.replay_until(old.version)
            budget = self.cfg.partitioned.device_bytes
            placed = graph.place(self.device, budget)
            own, _ = self.features.own_rows_on(as_tensor(base.features), self.device,
                                               budget - placed - self.features.hot_bytes)
            return live, graph, own, base

        live, graph, own, base = await asyncio.to_thread(build)
        if live.base_version <= old.base_version:
            return
        if live.log is not None:  # the records logged while it was built
            live.replay_until(self.live.version)
        else:
            live.catch_up()
        self.graph = self.sampler.graph = graph  # a batch under way keeps the old one
        self.features.rebase(own, live.written)
        self.live, self.base_x = live, base.features
        self.owned, self.edges = int(base.features.shape[0]), int(base.indices.size)
        self._refresh(moved=True)
        self.moves.moves += 1
        log.info("partition %d replica %d: serving from the base of version %d (version %d)",
                 args.part, args.replica, live.base_version, live.version)

    def drop_hot(self, ids: np.ndarray) -> int:
        """Drop the replicated copies of global ``ids`` held here, durably (a feature write to
        their owner follows); returns how many copies this server held."""
        ids = np.asarray(ids, np.int64)
        dropped = self.features.drop_hot(ids)
        if self.live.log is not None and dropped:  # replica 0 keeps the partition's file
            folder = self.live.directory
            save_dropped(folder, np.union1d(load_dropped(folder), ids))
        return dropped

    async def wait_version(self, version: int, timeout_s: float) -> int:
        """This partition's version once it reaches ``version`` (-1 past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        self._follow()
        while self.graph_version() < version:
            if time.monotonic() >= deadline:
                return -1
            await asyncio.sleep(0.005)
            self._follow()
        return self.graph_version()

    def graph_version(self) -> int:
        return self.live.version

    def growth(self) -> list[list[int]]:
        """The book's entries since the snapshot, ``[first id, count, owner]`` in id order."""
        self._follow()
        return [list(e) for e in self.live.entries]

    # ---- answering the other partition servers -------------------------------------------------
    def sample_hop(self, ids: np.ndarray, k: int, hop: int,
                   base: int) -> tuple[np.ndarray, np.ndarray] | dict[str, Any]:
        """Hop ``hop`` of the global ``ids`` this partition owns: (neighbours, count per id)."""
        self._follow()
        return self._hop(ids, k, hop, base)

    def _hop(self, ids: np.ndarray, k: int, hop: int,
             base: int) -> tuple[np.ndarray, np.ndarray] | dict[str, Any]:
        try:
            nbr, count = local_hop(self.graph, torch.from_numpy(np.asarray(ids, np.int64)), k,
                                   hop, base)
        except ValueError as exc:
            return {"code": "not_owned", "message": str(exc), "status": 400}
        return nbr.numpy(), count.numpy()

    def rows(self, ids: np.ndarray) -> np.ndarray | dict[str, Any]:
        """Feature rows of the global ``ids`` this partition owns."""
        self._follow()
        return self._rows(ids)

    def _rows(self, ids: np.ndarray) -> np.ndarray | dict[str, Any]:
        try:
            return self.features.own_rows(ids)
        except ValueError as exc:
            return {"code": "not_owned", "message": str(exc), "status": 400}

    async def _answer_wire(self, method: str, ids: np.ndarray, args: list[Any]) -> Any:
        if method == "embed":  # the ingress (decision 0054)
            exact, seed, timeout_s = args
            return await self.embed(ids, bool(exact), seed, timeout_s)
        self._follow()  # on the loop; the work may go to a thread
        if method == "sample_hop":
            return await off_loop(self._hop, int(ids.size), ids, *args)
        return await off_loop(self._rows, int(ids.size), ids)

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
        counts = self.features.counts
        return {"partition": self.args.part, "replica": self.args.replica, "pid": os.getpid(),
                "nodes": self.owned, "graph_nodes": self.num_nodes, "edges": self.edges,
                "device": str(self.device),
                "dim": self.model.out_dim, "features": self.features.dim,
                "requests": self.requests, "refused": self.refused, "ongoing": self.ongoing,
                "batches": self.batches.batches + self.exact_batches.batches,
                "transport": self.peers.settings.transport,
                "rows": {"local": counts.local, "hot": counts.hot, "remote": counts.remote},
                "hot_hit_rate": counts.hot_hit_rate(), "calls": self.peers.snapshot(),
                "version": self.graph_version(), "base_version": self.live.base_version,
                "overlay": self.live.overlay.usage(), "compaction": self.moves.snapshot(),
                "time_s": time.time()}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Release the partition's log (a server started again in this process takes it)."""
        self.live.close()
