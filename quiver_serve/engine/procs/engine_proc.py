"""The engine core process: its ZeroMQ sockets, its busy loop and its reports to the supervisor;
the work itself is :class:`~quiver_serve.engine.core.core.EngineCore`. The CPU sampler process is
``sampler_proc.py``. Sockets (all IPC, in the run
directory the supervisor made):

* engine ``i``: a ROUTER bound at ``engine-i.sock``; every front-end client connects a DEALER and
  sends micro-batches, and the reply goes back to the same client (ZeroMQ identity).
* sampler ``j``: a ROUTER bound at ``sampler-j.sock``; every engine core connects a DEALER, so a
  sampled subgraph goes straight back to the engine that asked for it.
* the supervisor's PULL at ``control.sock``: ready, failed, heartbeat.

A peer that dies (kill -9) only breaks its own connections; ZeroMQ reconnects when it is restarted
at the same address, and the sender learns of the loss from a socket monitor event.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.batch import SamplerPool
from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.core import EngineCore, MicroBatch, Reply
from quiver_serve.engine.procs.bytecode import compile_later
from quiver_serve.engine.procs.control import Reporter, bind_fresh, exit_failed
from quiver_serve.engine.procs.heap import start_gc_watch
from quiver_serve.engine.procs.process import parent_alive
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import LiveGraphArgs, MappedGraph, received
from quiver_serve.models.spec import ModelSpec
from quiver_serve.sampling.base import SamplerOutput
from quiver_serve.wire import (
    Decoders,
    MicroBatchDone,
    ModelCall,
    ModelReply,
    RunAddresses,
    SampleTask,
    disconnect_monitor,
    encode,
    unpack_requests,
    view,
)

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50
PARENT_CHECK_S = 0.05
#: replies up to this size are copied into ZeroMQ, larger ones sent zero-copy
REPLY_COPY_BYTES = 256 << 10


# ---- the CPU sampler pool, as an engine core reaches it -------------------------------------------
class ZmqSamplerPool(SamplerPool):
    """One DEALER per CPU sampler; tracks which batches each holds, to recover them if it dies."""

    def __init__(self, ctx: zmq.Context, addrs: RunAddresses, num_samplers: int,
                 poller: zmq.Poller) -> None:
        self.socks, self.monitors = [], []
        self.held: list[set[int]] = [set() for _ in range(num_samplers)]
        for j in range(num_samplers):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = disconnect_monitor(sock)
            sock.connect(addrs.sampler(j))
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            self.socks.append(sock)
            self.monitors.append(monitor)

    def outstanding(self) -> list[int]:
        return [len(h) for h in self.held]

    def send(self, worker: int, task_id: int, seeds: torch.Tensor, fanouts: list[int],
             seed: int) -> None:
        self.held[worker].add(task_id)
        self.socks[worker].send_multipart([encode(SampleTask(task_id, fanouts, seed)),
                                           seeds.numpy()], copy=False)

    def drain(self, core: EngineCore, events: dict) -> list[Reply]:
        """Take every sampler reply (and loss) that arrived; returns replies to send."""
        replies: list[Reply] = []
        for j, sock in enumerate(self.socks):
            if events.get(self.monitors[j]):
                self._on_monitor(core, j)
            if not events.get(sock):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                replies += self._on_reply(core, j, frames)
        return replies

    def _on_monitor(self, core: EngineCore, j: int) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitors[j], zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and self.held[j]:
                log.warning("sampler %d went away holding %d batch(es): sampling them here", j,
                            len(self.held[j]))
                core.pool_lost(sorted(self.held[j]))
                self.held[j].clear()

    def _on_reply(self, core: EngineCore, j: int, frames: list[Any]) -> list[Reply]:
        try:
            done = Decoders.sample_done.decode(frames[0].buffer)
        except Exception:  # noqa: BLE001 - a message we cannot read is logged, never silent
            log.error("sampler %d sent an unreadable reply; its batches are resampled here", j)
            core.pool_lost(sorted(self.held[j]))
            self.held[j].clear()
            return []
        self.held[j].discard(done.task_id)
        if done.error is not None:
            return core.on_sampled(done.task_id, None, done.sample_s, done.error)
        n_id = torch.from_numpy(view(frames[1], np.int64).copy())
        edges = torch.from_numpy(view(frames[2], np.int32).copy()).view(2, -1)
        seed_index = torch.from_numpy(view(frames[3], np.int64).copy())
        out = SamplerOutput(n_id, edges, seed_index, done.num_sampled_nodes, done.num_sampled_edges)
        return core.on_sampled(done.task_id, out, done.sample_s)


# ---- engine core process ----------------------------------------------------------------------------
def engine_process_setup(cfg: ServeConfig, index: int) -> None:
    """What every engine core process (typed or not) sets first: logging, torch's intra-op
    threads, and the interpreter's switch interval (decision 0058), which it logs."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.inference.torch_threads)
    sys.setswitchinterval(cfg.inference.switch_interval_ms / 1e3)
    log.info("engine %d: interpreter switch interval %.3g ms", index,
             sys.getswitchinterval() * 1e3)
    from quiver_serve.engine.procs.standby import PRELOAD_S

    if PRELOAD_S:  # a standby's imports, before its hand-over: what the build did not wait for
        log.info("engine %d: started in a standby whose imports took %s", index,
                 ", ".join(f"{name} {s:.2f} s" for name, s in PRELOAD_S.items()))
    compile_later(f"engine {index}")  # decision 0067: a no-op unless bytecode is kept aside


def engine_core_main(index: int, cfg: ServeConfig, given: GraphData | MappedGraph,
                     addrs: RunAddresses, live: LiveGraphArgs | None = None) -> None:
    """Entry point of engine core ``index`` (spawned); ``given``: the graph, or the folder it
    is mapped from (``living.handed``); ``live``: follow the graph's updates."""
    engine_process_setup(cfg, index)
    ctx = zmq.Context()
    reporter = Reporter(ctx, addrs, "engine", index)
    poller = zmq.Poller()
    try:
        graph = received(given)
        pool = ZmqSamplerPool(ctx, addrs, cfg.sampling.num_cpu_workers, poller) \
            if cfg.sampling.num_cpu_workers else None
        if live is not None:  # started after a compaction: serve its base
            from quiver_serve.graph.living import newest_base

            graph, live = newest_base(live, graph, copy=True)
        from pathlib import Path

        from quiver_serve.engine.procs.model_manager import PLAN_FILE
        from quiver_serve.models.startup import current_plan

        plan = current_plan(cfg, Path(addrs.run_dir) / PLAN_FILE)
        core = build_core(cfg, graph, index, pool, live=live, plan=plan)
        from quiver_serve.metrics.prometheus import EngineMetrics, GraphApplyMetrics

        core.on_stats = EngineMetrics().observe
        if core.graph_sync is not None:
            graph_metrics = GraphApplyMetrics(index)
            sync = core.graph_sync
            sync.on_applied = lambda kind, s: graph_metrics.on_applied(kind, s, sync.version)
            sync.on_poll = graph_metrics.on_poll
        from quiver_serve.engine.procs.table_metrics import table_metrics

        table_sync = table_metrics(core, index)
        core.defer_stats = True  # the loop records metrics after the replies are sent
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.RCVHWM, 0)
        bind_fresh(front, addrs.engine(index))
        poller.register(front, zmq.POLLIN)
        admin = ctx.socket(zmq.ROUTER)
        admin.setsockopt(zmq.LINGER, 0)
        bind_fresh(admin, addrs.engine_admin(index))
        poller.register(admin, zmq.POLLIN)
    except Exception as exc:  # noqa: BLE001 - reported on the control line, then exit 1
        exit_failed(reporter, exc)
    import signal

    signal.signal(signal.SIGUSR1, lambda *_: core.replacer.request())  # feature re-placement
    gc_watch = start_gc_watch(f"engine {index}", cfg.server.gc_freeze)
    reporter.send("ready", device=str(core.device), sampler=core.local_sampler.name,
                  gpu_sampler=getattr(core.gpu_sampler, "name", None), dim=core.model.out_dim,
                  features_on=str(core.features.device), gc_frozen_objects=gc_watch.frozen_objects,
                  **core.features.describe())
    loop = EngineLoop(core, front, pool, poller, reporter, cfg.inference.engine_spin_ms / 1e3,
                      gc_watch.flush, table_sync)
    loop.admin = ModelCalls(core, admin)
    compile_later(f"engine {index}")  # what the build imported (the model's, the metrics')
    loop.run()


class EngineLoop:
    """The engine core's busy loop: take input, ``step()``, send replies, beat."""

    def __init__(self, core: EngineCore, front: zmq.Socket, pool: ZmqSamplerPool | None,
                 poller: zmq.Poller, reporter: Reporter, spin_s: float = 0.0,
                 flush_gc: Callable[[], int] | None = None,
                 table_sync: Callable[[], None] | None = None) -> None:
        self.core, self.front, self.pool, self.poller = core, front, pool, poller
        self.reporter, self.spin_s = reporter, spin_s
        self.flush_gc = flush_gc or (lambda: 0)
        self.table_sync = table_sync or (lambda: None)
        #: the main process's model calls (``ModelCalls``); None: models fixed at start-up
        self.admin: ModelCalls | None = None
        self.last_answer_s = 0.0  # time.monotonic() of the last reply sent
        core.send_now = self.send_replies  # answers leave as soon as their batch is done

    def run(self) -> None:
        core = self.core
        next_check_s = 0.0
        while True:
            now_s = time.monotonic()
            if now_s >= next_check_s:  # a syscall: not on every turn of a busy loop
                if not parent_alive():
                    return
                next_check_s = now_s + PARENT_CHECK_S
                self.flush_gc()
                self.table_sync()
            # spin while the GPU holds batches (their completion is polled), else sleep in poll
            # and for ``spin_s`` after the last answer (the next request is likely near)
            if core.in_flight or core.sampled or (core.waiting and not core.former.fill.holding) \
                    or now_s - self.last_answer_s < self.spin_s \
                    or (core.loads is not None and core.loads.building):  # a budget per step
                timeout_ms = 0
            else:  # idle, at the pool, or holding a batch for the rest of its callers
                timeout_ms = 1 if core.sampling or core.waiting or core.exact_waiting \
                    or (core.graph_sync is not None and core.graph_sync.pending) else IDLE_POLL_MS
            events = dict(self.poller.poll(timeout_ms))
            replies = self._take_input() if events.get(self.front) else []
            if self.admin is not None and events.get(self.admin.sock):
                self.admin.take()
            if self.pool is not None:
                replies += self.pool.drain(core, events)
            replies += core.step()
            if replies:
                self.send_replies(replies)
            core.flush_stats()
            self.reporter.heartbeat()

    def send_replies(self, replies: list[Reply]) -> None:
        """Send replies now, each with the ids this engine core holds (for the clients'
        spreading)."""
        self.last_answer_s = time.monotonic()
        held_ids = self.core.ids_in_hand()
        for reply in replies:
            reply.done.engine_ids = held_ids
            self._send(reply)

    def _take_input(self) -> list[Reply]:
        replies: list[Reply] = []
        while True:
            try:
                # not copied: the views stay writable (the batch's seeds become a tensor)
                frames = self.front.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return replies
            mb = self._decode(frames)
            if isinstance(mb, Reply):
                replies.append(mb)
            elif mb is not None:
                refused = self.core.add(mb)
                if refused is not None:
                    replies.append(refused)

    def _decode(self, frames: list[Any]) -> MicroBatch | Reply | None:
        client = _raw(frames[0])
        try:
            head = Decoders.micro_batch.decode(_raw(frames[1]))
            if head.requests:
                ids, lengths, deadlines = unpack_requests(frames[2], head.requests)
            else:  # an older sender: three frames
                ids, lengths, deadlines = (view(frames[2], np.int64), view(frames[3], np.int64),
                                           view(frames[4], np.float64))
            mb = MicroBatch(client, head.seq, head.exact, head.seed, ids, lengths, deadlines,
                            outstanding_ids=head.outstanding_ids,
                            min_version=head.min_version, model=head.model,
                            version=head.version, node_type=head.node_type)
            if getattr(head, "new_nodes", 0):
                from quiver_serve.wire import decode_inductive

                new = decode_inductive(frames)
                mb.new_features, mb.new_offsets, mb.new_neighbors = new[:3]
                mb.new_relations = tuple(getattr(head, "new_relations", ()))
            return mb
        except Exception as exc:  # noqa: BLE001 - answered, and logged: never dropped silently
            log.error("engine %d: unreadable micro-batch from client %s: %s", self.core.index,
                      client.hex(), exc)
            seq = _peek_seq(frames)
            if seq is None:
                return None
            from quiver_serve.wire import RequestError

            err = RequestError(0, "invalid_request", "unreadable micro-batch", 400)
            return Reply(client, MicroBatchDone(seq, 0, [err]), None)

    def _send(self, reply: Reply) -> None:
        if reply.done.stats is not None:
            reply.done.stats.replied_s = time.time()  # the trip back starts here
        frames: list[Any] = [reply.client, encode(reply.done)]
        copy = True
        if reply.rows is not None:
            rows = np.ascontiguousarray(reply.rows, dtype=np.float32)
            frames.append(rows)
            # zero-copy only for large rows: a zero-copy frame's release wakes pyzmq's
            # garbage-collector thread, which then contends for this loop's GIL
            copy = rows.nbytes <= REPLY_COPY_BYTES
        try:
            self.front.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as exc:  # the client went away: nobody to answer
            log.debug("reply to %s dropped: %s", reply.client.hex(), exc)


class ModelCalls:
    """The main process's model calls to this engine core (``wire.ModelCall``), answered on the
    same socket; loads and unloads answer when they are done (``engine/core/model_load.py``),
    always from the loop thread."""

    def __init__(self, core: EngineCore, sock: zmq.Socket) -> None:
        self.core, self.sock = core, sock

    def take(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                call = Decoders.model_call.decode(frames[1])
            except Exception as exc:  # noqa: BLE001 - no call id to answer: logged, dropped
                log.error("engine %d: unreadable model call dropped: %s", self.core.index, exc)
                continue
            self._run(frames[0], call)

    def _run(self, ident: bytes, call: ModelCall) -> None:
        core = self.core

        def done(result: dict[str, Any] | None, error: str | None) -> None:
            reply = ModelReply(call.call_id, error is None, result or {}, error or "")
            try:
                self.sock.send_multipart([ident, encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the main process went away
                log.debug("model reply dropped: %s", exc)

        try:
            if call.op == "load":
                core.loads.load(ModelSpec.from_dict(call.spec), done)
            elif call.op == "unload":
                core.loads.unload(call.name, call.version, done)
            elif call.op == "activate":
                core.models.set_traffic(call.name, {int(v): w for v, w in call.traffic.items()})
                if call.default:
                    core.models.default = call.default
                core.loads.follow_table(call.name)  # the exact table follows the main version
                done(self.describe(), None)
            elif call.op == "list":
                done(self.describe(), None)
            else:
                done(None, f"unknown model op {call.op!r}")
        except Exception as exc:  # noqa: BLE001 - answered, never fatal to the engine
            log.exception("engine %d: model call %s failed", core.index, call.op)
            done(None, f"{type(exc).__name__}: {exc}")

    def describe(self) -> dict[str, Any]:
        return {"default": self.core.models.default,
                "slots": [s.describe() for s in self.core.models.each()]}


def _peek_seq(frames: list[Any]) -> int | None:
    import msgspec

    try:
        raw = msgspec.msgpack.decode(_raw(frames[1]))
        return int(raw[0])
    except Exception:  # noqa: BLE001
        return None


def _raw(frame: Any) -> Any:
    """A received frame's bytes: a ``zmq.Frame``'s (``copy=False``), or the bytes themselves."""
    return frame.bytes if isinstance(frame, zmq.Frame) else frame
