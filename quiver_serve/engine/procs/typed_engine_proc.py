"""The engine core process of a typed graph (docs/architecture.md, "Typed graphs"): the typed
graph loaded here from ``cfg.graph`` (``graph/typed_load.py``), a ``TypedEngineCore``, and the
homogeneous loop's decoding and replies (``engine_proc.EngineLoop``) around it. The main
process and its clients are those of the homogeneous daemon; the engine core checks each
request's node type and ids per type. The core follows the update log (``typed_sync.py``): the
log is replayed onto the graph before the model and the exact table are built."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import zmq

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.devices import worker_device
from quiver_serve.engine.core.typed_core import TypedEngineCore, build_typed_core
from quiver_serve.engine.core.typed_sync import TypedSync
from quiver_serve.engine.procs.bytecode import compile_later
from quiver_serve.engine.procs.control import Reporter, bind_fresh, exit_failed
from quiver_serve.engine.procs.engine_proc import (
    IDLE_POLL_MS,
    PARENT_CHECK_S,
    EngineLoop,
    engine_process_setup,
)
from quiver_serve.engine.procs.process import parent_alive
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.graph.typed_base import typed_graph_at_start
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.wire import RunAddresses

log = logging.getLogger(__name__)


def config_is_typed(cfg: ServeConfig) -> bool:
    """Whether ``cfg`` serves a typed graph: a model made typed (``model.to_hetero``), words as
    nodes (``graph.words_as_nodes``), a typed synthetic preset, or a ``graph.path`` holding a
    typed graph (``holds_typed_graph``: a saved ``HeteroData``, a typed npz)."""
    from quiver_serve.graph.typed_load import holds_typed_graph
    from quiver_serve.graph.typed_synthetic import TYPED_PRESETS

    g = cfg.graph
    return cfg.model.to_hetero is not None or bool(g.words_as_nodes) or \
        (g.format == "synthetic" and g.synthetic_preset in TYPED_PRESETS) or \
        holds_typed_graph(g)


def typed_engine_main(index: int, cfg: ServeConfig, given: object, addrs: RunAddresses,
                      live: object = None) -> None:
    """Entry point of typed engine core ``index`` (spawned, the arguments of
    ``engine_proc.engine_core_main``): the typed graph loaded here from ``cfg.graph`` (``given``,
    the main process's stand-in, is not read) with the update log in ``live`` replayed onto it,
    build, report ready, serve until the parent goes."""
    engine_process_setup(cfg, index)
    ctx = zmq.Context()
    reporter = Reporter(ctx, addrs, "engine", index)
    poller = zmq.Poller()
    try:
        sync = None
        if not isinstance(live, LiveGraphArgs):
            graph = load_typed_graph(cfg.graph)
        else:  # the newest typed base, then the log after it
            graph, base_version = typed_graph_at_start(cfg.graph, Path(live.log_dir))
            live = dataclasses.replace(live, base_version=base_version)
            sync = TypedSync(live, TypedLiveGraph(graph, cfg.graph.add_reverse_edges), index)
            replayed = sync.catch_up()
            if replayed:
                log.info("engine %d: %d typed update(s) replayed (version %d)", index, replayed,
                         sync.version)
        core = build_engine_core(cfg, graph, index)
        core.sync = sync
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.RCVHWM, 0)
        bind_fresh(front, addrs.engine(index))
        poller.register(front, zmq.POLLIN)
    except Exception as exc:  # noqa: BLE001 - reported on the control line, then exit 1
        exit_failed(reporter, exc)
    dims = sorted(set(core.out_dims.values()))
    gpu = getattr(core, "gpu_sampler", None)
    reporter.send("ready", device=str(getattr(core, "device", "cpu")), sampler=core.sampler.name,
                  gpu_sampler=None if gpu is None else gpu.name,
                  dim=dims[0] if len(dims) == 1 else 0, node_types=dict(core.graph.num_nodes),
                  dims=core.out_dims)
    compile_later(f"engine {index}")  # what the build imported (decision 0067)
    TypedEngineLoop(core, front, poller, reporter).run()


def build_engine_core(cfg: ServeConfig, graph: TypedGraph, index: int) -> TypedEngineCore:
    """Engine core ``index`` over ``graph``: on a GPU when the core's device is one
    (``engine/core/typed_gpu.py``), else on the CPU."""
    if worker_device(cfg, index).type == "cuda":
        from quiver_serve.engine.core.typed_gpu import build_typed_gpu_core

        return build_typed_gpu_core(cfg, graph, index)
    return build_typed_core(cfg, graph, index)


class TypedEngineLoop(EngineLoop):
    """``EngineLoop`` around a ``TypedEngineCore``: take input, ``step()``, send, beat."""

    def __init__(self, core: TypedEngineCore, front: zmq.Socket, poller: zmq.Poller,
                 reporter: Reporter) -> None:
        super().__init__(core, front, None, poller, reporter)  # type: ignore[arg-type]
        if hasattr(core, "on_typed_stats"):  # the GPU core: metrics labelled by node type
            from quiver_serve.metrics.typed import TypedMetrics

            core.on_typed_stats = TypedMetrics().observe

    def run(self) -> None:
        core = self.core
        next_check_s = 0.0
        while True:
            now_s = time.monotonic()
            if now_s >= next_check_s:
                if not parent_alive():
                    return
                next_check_s = now_s + PARENT_CHECK_S
            stepping = core.parked or core.refreshing()
            wait_ms = 0 if core.busy() else (1 if stepping else IDLE_POLL_MS)
            events = dict(self.poller.poll(wait_ms))
            replies = self._take_input() if events.get(self.front) else []
            replies += core.step()
            if replies:
                self.send_replies(replies)
            self.reporter.heartbeat()
