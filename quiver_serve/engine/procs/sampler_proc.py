"""The CPU sampler process: a ROUTER at ``sampler-j.sock`` (``wire.RunAddresses``); every engine
core connects a DEALER, so a sampled subgraph goes straight back to the engine core that asked."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.rebase import apply_structure
from quiver_serve.engine.procs.bytecode import compile_later
from quiver_serve.engine.procs.control import Reporter, bind_fresh, exit_failed
from quiver_serve.engine.procs.heap import start_gc_watch
from quiver_serve.engine.procs.process import parent_alive
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import LiveGraphArgs, MappedGraph, newest_base, received
from quiver_serve.graph.overlay import Overlay
from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.graph.records import EdgeRecord, NodeRecord
from quiver_serve.graph.state import NEWEST_BASE, GraphState
from quiver_serve.graph.update_log import LogFollower
from quiver_serve.sampling import make_cpu_sampler
from quiver_serve.wire import Decoders, RunAddresses, SampleDone, encode, view

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50


class SamplerSync:
    """A CPU sampler's own overlay of the living graph, brought to the acknowledged version
    before each task (the same records, in the same order, as every engine core applies)."""

    def __init__(self, sampler: Any, indptr: torch.Tensor, indices: torch.Tensor,
                 live: LiveGraphArgs, index: int, implementation: str) -> None:
        self.sampler, self.live, self.index = sampler, live, index
        self.implementation = implementation
        self.overlay = Overlay(indptr, indices, live.caps.node_capacity, live.caps.edge_capacity,
                               live.base_version)
        self.follower = LogFollower(Path(live.log_dir), live.base_version)
        self.state = GraphState(live.state)
        self.version = self.base_version = live.base_version
        self.state.set_reader_base("sampler", index, self.base_version)
        self.state.set_sampler_version(index, self.version)
        self.view: OverlayView | None = None

    def rebase_if_newer(self) -> None:
        """Sample over the newest compacted base: its arrays are mapped (no copy), its log
        records replayed into a fresh overlay; between two tasks."""
        if self.state.get(NEWEST_BASE) <= self.base_version:
            return
        empty = GraphData("base", torch.zeros(1, dtype=torch.int64),
                          torch.zeros(0, dtype=torch.int64), torch.zeros((0, 0)))
        graph, live = newest_base(self.live, empty, with_x=False)
        if live.base_version <= self.base_version:
            return
        overlay = Overlay(graph.indptr, graph.indices, live.caps.node_capacity,
                          live.caps.edge_capacity, live.base_version)
        follower = LogFollower(Path(live.log_dir), live.base_version)
        version = live.base_version
        while version < self.version:
            records = follower.poll(self.version - version)
            if not records:
                raise RuntimeError(f"update log ends at version {version} before {self.version}")
            for record in records:
                apply_structure(overlay, record)
                version = record.version
        self.follower.close()
        sampler = make_cpu_sampler(graph.indptr, graph.indices, self.implementation)
        self.sampler, self.overlay, self.follower, self.live = sampler, overlay, follower, live
        self.view = None
        if overlay.active or overlay.num_nodes > overlay.n_base:
            overlay.ensure_active()
            self.view = overlay.view()
            sampler.set_overlay(self.view)
        self.base_version = live.base_version
        self.state.set_reader_base("sampler", self.index, self.base_version)
        log.info("sampler %d: on the compacted base of version %d", self.index, self.base_version)

    def catch_up(self) -> None:
        try:
            self.rebase_if_newer()
        except Exception:  # noqa: BLE001 - keeps sampling over its current base
            log.exception("sampler %d: moving to the compacted base failed", self.index)
        while self.state.acked > self.version:
            records = self.follower.poll(4096)
            if not records:
                return  # acknowledged before its bytes are readable here: next task
            for record in records:
                self._apply(record)

    def _apply(self, record: Any) -> None:
        apply_structure(self.overlay, record)
        if self.view is None and isinstance(record, EdgeRecord | NodeRecord):
            self.overlay.ensure_active()  # new ids are known to the sampler even without edges
            self.view = self.overlay.view()
            self.sampler.set_overlay(self.view)
        if self.view is not None:
            self.view.num_nodes = self.overlay.num_nodes
        self.version = record.version
        self.state.set_sampler_version(self.index, self.version)


def sampler_main(index: int, cfg: ServeConfig, given: GraphData | MappedGraph,
                 addrs: RunAddresses, live: LiveGraphArgs | None = None) -> None:
    """Entry point of CPU sampler ``index``: sample what engine cores ask, answer the asker
    (``given``: the graph, or the folder it is mapped from: ``living.handed``)."""
    torch.set_num_threads(cfg.sampling.cpu_threads_per_worker)
    ctx = zmq.Context()
    reporter = Reporter(ctx, addrs, "sampler", index)
    compile_later(f"sampler {index}")  # decision 0067: a no-op unless bytecode is kept aside
    try:
        graph = received(given)
        indptr, indices = graph.indptr, graph.indices
        sync = None
        if live is not None:  # started after a compaction: sample over its base
            from quiver_serve.graph.living import newest_base

            base = GraphData("base", indptr, indices, torch.zeros((indptr.numel() - 1, 0)))
            base, live = newest_base(live, base, with_x=False)
            indptr, indices = base.indptr, base.indices
        sampler = make_cpu_sampler(indptr, indices, cfg.sampling.implementation)
        if live is not None:
            sync = SamplerSync(sampler, indptr, indices, live, index, cfg.sampling.implementation)
        if sync is not None:
            sync.catch_up()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        bind_fresh(sock, addrs.sampler(index))
    except Exception as exc:  # noqa: BLE001 - reported on the control line, then exit 1
        exit_failed(reporter, exc)
    gc_watch = start_gc_watch(f"sampler {index}", cfg.server.gc_freeze)
    reporter.send("ready", impl=sampler.name, gc_frozen_objects=gc_watch.frozen_objects)
    while parent_alive():
        reporter.heartbeat()
        gc_watch.flush()
        if not sock.poll(IDLE_POLL_MS):
            if sync is not None:  # idle: follow the log and the bases all the same
                sync.catch_up()
            continue
        ident, head, seeds = sock.recv_multipart(copy=False)
        if sync is not None:
            sync.catch_up()
            sampler = sync.sampler
        sock.send_multipart([ident.bytes, *_sample_reply(sampler, head, seeds, index)], copy=False)


def _sample_reply(sampler: Any, head: Any, seeds_frame: Any, index: int) -> list[Any]:
    t0 = time.perf_counter()
    try:
        task = Decoders.task.decode(head.buffer)
    except Exception as exc:  # noqa: BLE001
        log.error("sampler %d: unreadable task: %s", index, exc)
        return [encode(SampleDone(-1, [], [], 0.0, "unreadable task"))]
    try:
        seeds = torch.from_numpy(view(seeds_frame, np.int64).copy())
        out = sampler.sample(seeds, task.fanouts, task.seed)
    except Exception as exc:  # noqa: BLE001 - the engine fails this batch only
        log.exception("sampler %d: task %d failed", index, task.task_id)
        return [encode(SampleDone(task.task_id, [], [], 0.0, f"{type(exc).__name__}"))]
    done = SampleDone(task.task_id, out.num_sampled_nodes, out.num_sampled_edges,
                      time.perf_counter() - t0)
    return [encode(done), out.n_id.numpy(), out.edge_index.to(torch.int32).numpy(),
            out.seed_index.numpy()]
