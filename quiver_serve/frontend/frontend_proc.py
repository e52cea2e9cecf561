"""One HTTP front-end process of several (``server.http_workers`` > 1).

It binds ``server.port`` with ``SO_REUSEPORT`` (``frontend/listen.py``) and runs the same FastAPI app
as the single-process daemon, whose pipeline is a :class:`RemotePipeline`: an
:class:`EngineClient` of every engine core of the main process, built from the state the main
process publishes (``wire.FrontDoorState``, ZeroMQ PUB/SUB, about ten times a second). A watch
thread reads that state, reports ready and heartbeats to the main process (only while the event
loop answers, so a wedged loop gets the front-end restarted), drains when the main process
drains, and exits when the main process is gone. A front-end that cannot start (FastAPI missing,
the port refused) reports ``failed`` with the error on the same line before it exits, so the main
process can name the cause when it gives up on a front-end that keeps failing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.engine.client.facade import ClientFacade
from quiver_serve.engine.client.graph_client import (
    ModelOps,
    RemoteGraph,
    graph_timeout_s,
    model_timeout_s,
)
from quiver_serve.engine.procs.bytecode import compile_later
from quiver_serve.engine.procs.control import Reporter, exit_failed
from quiver_serve.engine.procs.graph_service import unavailable
from quiver_serve.engine.procs.heap import GcWatch, start_gc_watch
from quiver_serve.engine.procs.process import parent_alive
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import Decoders, FrontDoorAddresses, FrontDoorState

log = logging.getLogger(__name__)

WATCH_S = 0.1
#: the event loop must run a callback within this long for heartbeats to go on
LOOP_STALL_S = 5.0
#: after the drain, how long uvicorn waits for connections still mid-request
GRACEFUL_S = 2


class RemotePipeline(ClientFacade):
    """What the app needs, served by a client of the main process's engine cores; graph calls
    go to the main process's graph writer (``graph_address``, ``engine/procs/graph_service.py``).

    ``num_nodes`` follows the node count the main process publishes and the answers of this
    front-end's own node additions (so a caller can embed a node right after adding it here);
    ``node_capacity`` bounds the ids that may exist by the time a request reaches an engine."""

    def __init__(self, cfg: ServeConfig, index: int, graph_address: str | None = None) -> None:
        self.cfg, self.index = cfg, index
        self.observer: PipelineObserver = PipelineObserver()
        self.client: EngineClient | None = None
        self.num_nodes = 0
        self.node_capacity = 0
        #: the acknowledged graph version; None while the main process has no graph writer
        self.graph_version: int | None = None
        self.out_dim: int | None = None
        self.num_features: int | None = None
        self.engines_ready = False
        self._workers: list[dict[str, Any]] = []
        self._init_facade(f"f{index}-")
        self.graph_ops = RemoteGraph(graph_address or "", graph_timeout_s(
            cfg.server.request_timeout_s), self._graph_check, self._on_graph_result)
        self._graph_address = graph_address
        #: every model and version with its state, as the main process publishes it
        self.models_state: dict[str, Any] | None = None
        #: the model repository's calls, over the same channel as the graph's
        self.model_ops = ModelOps(RemoteGraph(graph_address or "", model_timeout_s(cfg),
                                              self._model_check, lambda op, result: None))

    def start(self) -> None:
        """Nothing to start: the client is built when the main process says the engines are up."""

    def on_state(self, state: FrontDoorState) -> None:
        """Called by the watch thread with each state the main process publishes."""
        self._workers = [msgspec.structs.asdict(w) for w in state.workers]
        self.engines_ready = state.engines_ready
        self._follow_graph(state)
        if state.models is not None:
            self.models_state = state.models
        if self.client_endpoints is None and state.engines is not None and not self._draining:
            endpoints = msgspec.convert(state.engines, EngineEndpoints)
            self.num_nodes = max(self.num_nodes, endpoints.num_nodes)
            self.node_capacity = max(self.node_capacity, self.num_nodes)
            self.out_dim = endpoints.dim
            self.num_features = state.num_features
            self.client_endpoints = endpoints  # each event loop connects its own client
            self._accepting = True
            log.info("front-end %d: serving (pid %d)", self.index, os.getpid())

    def _follow_graph(self, state: FrontDoorState) -> None:
        """Counts only grow: a state published before this front-end's own node additions were
        acknowledged must not hide them."""
        if state.num_nodes is not None:
            self.num_nodes = max(self.num_nodes, state.num_nodes)
        if state.node_capacity is not None:
            self.node_capacity = max(self.node_capacity, state.node_capacity, self.num_nodes)
        if state.graph_version is not None:
            self.graph_version = max(self.graph_version or 0, state.graph_version)

    def _graph_check(self) -> None:
        """Graph calls can be made now (else the 503 or 501 to answer)."""
        if not self.ready:
            raise self.refusal()
        if self.graph_version is None or self._graph_address is None:
            raise unavailable()

    def _model_check(self) -> None:
        """Model calls can be made now (else the 503 to answer)."""
        if not self.ready or self._graph_address is None:
            raise self.refusal()

    def _on_graph_result(self, op: str, result: dict[str, Any]) -> None:
        if op == "add_nodes" and result.get("node_ids") and not result.get("node_type"):
            self.num_nodes = max(self.num_nodes, int(max(result["node_ids"])) + 1)
            self.node_capacity = max(self.node_capacity, self.num_nodes)
        version = result.get("version")
        if isinstance(version, int) and op != "compact":
            self.graph_version = max(self.graph_version or 0, version)

    def workers(self) -> list[dict[str, Any]]:
        return list(self._workers)

    def stop(self) -> None:
        self.begin_drain()
        self._stopping.set()
        self.stop_clients()


class Watch:
    """The front-end's line to the main process (one thread owns both ZeroMQ sockets)."""

    def __init__(self, reporter: Reporter, addrs: FrontDoorAddresses, pipeline: RemotePipeline,
                 server: Any, gc_watch: GcWatch | None = None) -> None:
        self.gc_watch = gc_watch
        self.pipeline, self.server, self.index = pipeline, server, reporter.index
        self.reporter = reporter
        self.sub = reporter.sock.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.CONFLATE, 1)  # only the newest state matters
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(addrs.state)
        self.loop_beat_s = time.monotonic()
        self._reported_ready = False
        self.thread = threading.Thread(target=self._run, name="quiver-frontend-watch", daemon=True)

    def _beat(self) -> None:
        self.loop_beat_s = time.monotonic()

    def _run(self) -> None:
        try:
            while True:
                if not parent_alive():
                    log.error("front-end %d: the main process is gone; exiting", self.index)
                    os._exit(1)
                if self.sub.poll(int(WATCH_S * 1000)):
                    state = Decoders.front_door.decode(self.sub.recv())
                    self.pipeline.on_state(state)
                    if state.draining:
                        self.server.drain("the main process is draining")
                self._report()
                if self.gc_watch is not None:
                    self.gc_watch.flush()
        except Exception:  # noqa: BLE001 - without this thread the front-end is blind: restart it
            log.exception("front-end %d: watch thread failed; exiting", self.index)
            os._exit(1)

    def _report(self) -> None:
        loop = self.server.loop
        if loop is None or not self.server.started:
            return
        if not self._reported_ready:
            self._reported_ready = True
            self.reporter.send("ready", pid=os.getpid(), gc_frozen_objects=getattr(
                self.gc_watch, "frozen_objects", None))
        try:
            loop.call_soon_threadsafe(self._beat)
        except RuntimeError:  # the loop closed: shutting down
            return
        if time.monotonic() - self.loop_beat_s < LOOP_STALL_S:
            self.reporter.heartbeat()


def frontend_main(index: int, cfg: ServeConfig, run_dir: str, log_level: str) -> None:
    """Entry point of a spawned front-end process."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    addrs = FrontDoorAddresses(run_dir)
    # the control line first: a failure in what follows is reported on it, then exit 1
    reporter = Reporter(zmq.Context(), addrs, "frontend", index)  # type: ignore[arg-type]
    try:
        pipeline = RemotePipeline(cfg, index, addrs.graph)
        server, sock = _build_server(cfg, pipeline, log_level)
        watch = Watch(reporter, addrs, pipeline, server,
                      start_gc_watch(f"frontend {index}", cfg.server.gc_freeze))
    except Exception as exc:  # noqa: BLE001 - e.g. FastAPI missing: said once, then exit 1
        exit_failed(reporter, exc)
    watch.thread.start()
    compile_later(f"frontend {index}")  # decision 0067: a no-op unless bytecode is kept aside
    server.run(sockets=[sock])


def _build_server(cfg: ServeConfig, pipeline: RemotePipeline, log_level: str) -> tuple[Any, Any]:
    """The app on a uvicorn server, and the ``SO_REUSEPORT`` socket it will serve."""
    import uvicorn

    from quiver_serve.frontend.app import create_app
    from quiver_serve.frontend.listen import DrainingServer, reuseport_socket, uvicorn_options

    app = create_app(cfg, pipeline)
    s = cfg.server
    sock = reuseport_socket(s.host, s.port, listen=True)
    # The drain has already waited for every admitted request; what is left at shutdown is a
    # request still being read, so the graceful wait for connections is short.
    server = DrainingServer(uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=GRACEFUL_S,
        **uvicorn_options(app)), pipeline, s.drain_timeout_s)
    return server, sock
