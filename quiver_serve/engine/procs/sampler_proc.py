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
from quiver_serve.engine.procs.control import Reporter, bind_fresh, exit_failed
from quiver_serve.engine.procs.heap import start_gc_watch
from quiver_serve.engine.procs.process import parent_alive
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.overlay import Overlay
from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.graph.records import EdgeRecord, NodeRecord
from quiver_serve.graph.state import GraphState
from quiver_serve.graph.update_log import LogFollower
from quiver_serve.sampling import make_cpu_sampler
from quiver_serve.wire import Decoders, RunAddresses, SampleDone, encode, view

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50


class SamplerSync:
    """A CPU sampler's own overlay of the living graph, brought to the acknowledged version
    before each task (the same records, in the same order, as every engine core applies)."""

    def __init__(self, sampler: Any, indptr: torch.Tensor, indices: torch.Tensor,
                 live: LiveGraphArgs) -> None:
        self.sampler = sampler
        self.overlay = Overlay(indptr, indices, live.caps.node_capacity, live.caps.edge_capacity)
        self.follower = LogFollower(Path(live.log_dir), live.base_version)
        self.state = GraphState(live.state)
        self.version = live.base_version
        self.view: OverlayView | None = None

    def catch_up(self) -> None:
        while self.state.acked > self.version:
            records = self.follower.poll(4096)
            if not records:
                return  # acknowledged before its bytes are readable here: next task
            for record in records:
                self._apply(record)

    def _apply(self, record: Any) -> None:
        if isinstance(record, EdgeRecord):
            self.overlay.apply_edges(record.add, record.remove)
            if self.view is None:
                self.view = self.overlay.view()
                self.sampler.set_overlay(self.view)
        elif isinstance(record, NodeRecord):
            self.overlay.add_nodes(int(record.features.shape[0]))
        if self.view is not None:
            self.view.num_nodes = self.overlay.num_nodes
        self.version = record.version


def sampler_main(index: int, cfg: ServeConfig, indptr: torch.Tensor, indices: torch.Tensor,
                 addrs: RunAddresses, live: LiveGraphArgs | None = None) -> None:
    """Entry point of CPU sampler ``index``: sample what engine cores ask, answer the asker."""
    torch.set_num_threads(cfg.sampling.cpu_threads_per_worker)
    ctx = zmq.Context()
    reporter = Reporter(ctx, addrs, "sampler", index)
    try:
        sampler = make_cpu_sampler(indptr, indices, cfg.sampling.implementation)
        sync = SamplerSync(sampler, indptr, indices, live) if live is not None else None
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
            continue
        ident, head, seeds = sock.recv_multipart(copy=False)
        if sync is not None:
            sync.catch_up()
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
