"""Scale-out on Ray Serve: N engine replicas (one per GPU) behind Ray's HTTP proxy.

* The graph (CSC ``indptr``/``indices``, features) is put into Ray's object store once, as NumPy
  arrays, by the driver. Ray moves an object to a node once; every replica on that node maps the
  same shared-memory copy (zero-copy reads; a GPU replica then copies what it places on its GPU).
* ``EngineReplica``: one engine core (``LocalEngine``) per replica, ``num_gpus=1`` where there
  are GPUs; ``max_ongoing_requests`` bounds its queue; Ray's autoscaler can size the replica
  count on ongoing requests (``--autoscale``).
* ``Ingress``: the daemon's ``POST /v1/embed`` contract (same body, same JSON answer, same error
  bodies and status codes) on Ray's HTTP proxy. A request whose replica dies (kill -9, a lost
  node) is retried once on another replica, so a lost replica loses no request.

Run: ``python -m quiver_serve.scaleout.ray_serve --replicas 2`` (the embedded default; ``--config X.yaml``: another)
(``--address auto`` joins a running cluster). In this replica mode every node holds the whole
graph, and the KServe routes and ``/metrics`` of the daemon are not served (Ray Serve exports its
own request metrics).

``--partitions P`` (P > 1) serves a graph partitioned across hosts instead: one partition server
per partition and replica, an ingress with the daemon's HTTP contract
(``scaleout/partitioned/``; docs/architecture.md, "Partitioned serving"). ``--partitions 1`` is
the replica mode above.
"""


import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.frontend.bodies import validation_message
from quiver_serve.frontend.responses import embed_answer, error_response, serve_error_response
from quiver_serve.frontend.schemas import EmbedBody
from quiver_serve.graph.csc import GraphData
from quiver_serve.scaleout.ray_start import (
    Reservations,
    StartError,
    first_answer,
    size_replicas,
    wait_running,
)

log = logging.getLogger(__name__)

APP_NAME = "quiver-serve"
#: how long a readiness probe waits for an engine replica
READY_PROBE_S = 2.0
#: exceptions that mean "the replica is gone": retried once on another replica
RETRIES = 1


def graph_arrays(graph: GraphData) -> dict[str, Any]:
    """The graph as NumPy arrays (what goes into the object store) plus its name."""
    return {"name": graph.name, "indptr": graph.indptr.numpy(), "indices": graph.indices.numpy(),
            "x": graph.x.numpy()}


def graph_from_arrays(arrays: dict[str, Any]) -> GraphData:
    """GraphData over the object store's read-only arrays, without copying them."""
    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a) if a.flags.writeable else _readonly_tensor(a)
    return GraphData(arrays["name"], tensor(arrays["indptr"]), tensor(arrays["indices"]),
                     tensor(arrays["x"]))


def _readonly_tensor(a: np.ndarray) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # torch warns that writing would be undefined: nothing writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class EngineReplica:
    """One engine core (one GPU, or the CPU) serving ``embed`` calls from the ingress."""

    def __init__(self, cfg_dict: dict[str, Any], graph_ref: dict[str, Any]) -> None:
        import ray

        from quiver_serve.engine.client.local import LocalEngine

        cfg = ServeConfig.model_validate(cfg_dict)
        arrays = ray.get(graph_ref["ref"])  # zero-copy views of this node's shared copy
        self.engine = LocalEngine(cfg, graph_from_arrays(arrays))

    def embed(self, node_ids: np.ndarray, exact: bool, seed: int | None,
              timeout_s: float | None) -> np.ndarray | dict[str, Any]:
        """Rows, or the error as a plain dict (exceptions would lose their status over Ray)."""
        try:
            return self.engine.embed(node_ids, exact, seed, timeout_s)
        except errors.ServeError as exc:
            return {"code": exc.info.code, "message": exc.info.message, "status": exc.info.status}

    def pid(self) -> int:
        return os.getpid()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def _error(status: int, code: str, message: str) -> JSONResponse:
    """A refusal of the request itself (4xx: no Retry-After), in the daemon's error body; a
    replica's refusals go through ``Ingress._refuse`` (503s carry ``server.retry_after_s``)."""
    return error_response(status, code, message)


APP = FastAPI(title="quiver-serve on Ray Serve",
              description="POST /v1/embed with the daemon's contract, answered by engine replicas")


@APP.exception_handler(RequestValidationError)
async def _malformed(request: Any, exc: RequestValidationError) -> JSONResponse:
    """A body the schema refuses: 422 ``invalid_request``, worded as the daemon words it."""
    return error_response(422, "invalid_request", validation_message(list(exc.errors())),
                          path=request.url.path)


@serve.ingress(APP)
class Ingress:
    """``POST /v1/embed`` on Ray's HTTP proxy, answered by the engine replicas."""

    def __init__(self, engine: Any, cfg_dict: dict[str, Any], num_nodes: int) -> None:
        self.engine = engine
        self.cfg = ServeConfig.model_validate(cfg_dict)
        self.num_nodes = num_nodes

    @APP.post("/v1/embed", summary="Embeddings for node ids (the daemon's /v1/embed)")
    async def embed(self, body: EmbedBody) -> Response:
        refused = self._check(body)
        if refused is not None:
            return refused
        ids = np.asarray(body.node_ids, dtype=np.int64)
        timeout_s = None if body.timeout_ms is None else body.timeout_ms / 1000.0
        out = await self._call(ids, body.exact, body.seed, timeout_s)
        if isinstance(out, dict):
            return self._refuse(errors.ServeError(out["code"], out["message"], out["status"]))
        content, media_type = embed_answer(self.cfg.model.name, out, None)
        return Response(content, media_type=media_type)

    def _refuse(self, exc: errors.ServeError) -> JSONResponse:
        """A replica's refusal (503 overloaded or lost, 504 deadline) as the daemon answers it."""
        return serve_error_response(exc, self.cfg.server.retry_after_s)

    @APP.get("/v2/health/live", summary="Liveness")
    async def live(self) -> dict[str, bool]:
        return {"live": True}

    @APP.get("/v2/health/ready", summary="Readiness: an engine replica answers")
    async def ready(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.pid.remote(), READY_PROBE_S)
        except Exception as exc:  # noqa: BLE001 - no replica: not ready, whatever the cause
            return self._refuse(errors.unavailable("not_ready", f"no engine replica answers "
                                                                f"({type(exc).__name__})"))
        return JSONResponse({"ready": True})

    def _check(self, body: EmbedBody) -> JSONResponse | None:
        """The daemon's checks of the ids (``errors.check_node_ids``), answered as it answers;
        the living graph's fields are refused (replicas serve the graph they started with)."""
        if getattr(body, "min_version", None) or getattr(body, "new_nodes", None):
            return _error(400, "unsupported_on_ray", "min_version and new_nodes need the "
                          "daemon's living graph; the Ray Serve path serves a fixed graph")
        try:
            errors.check_node_ids(np.asarray(body.node_ids, dtype=np.int64), self.num_nodes,
                                  self.cfg.server.max_request_nodes)
        except errors.ServeError as exc:
            return _error(exc.info.status, exc.info.code, exc.info.message)
        return None

    async def _call(self, ids: np.ndarray, exact: bool, seed: int | None,
                    timeout_s: float | None) -> Any:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        for attempt in range(RETRIES + 1):
            try:
                return await self.engine.embed.remote(ids, exact, seed, timeout_s)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
                if attempt == RETRIES:
                    return {"status": 503, "code": "replica_lost",
                            "message": f"the engine replica was lost ({type(exc).__name__})"}
                log.warning("engine replica lost (%s); retrying on another", type(exc).__name__)
                await asyncio.sleep(0.05)
        raise AssertionError("unreachable")


def build_app(cfg: ServeConfig, graph: GraphData, num_replicas: int = 2,
              gpus_per_replica: float | None = None, autoscale: bool = False,
              reservations: Reservations | None = None) -> Any:
    """The Ray Serve application (call after ``ray.init``): graph into the object store once.
    ``reservations``: what each replica and the ingress reserve (default: sized to the cluster,
    ``ray_start.size_replicas``)."""
    import ray

    if reservations is None:
        reservations = size_replicas(ray.cluster_resources(), num_replicas, gpus_per_replica)
    graph_ref = {"ref": ray.put(graph_arrays(graph))}  # nested: replicas ray.get it themselves
    cfg_dict = cfg.model_dump(mode="json")
    scaling: dict[str, Any] = {"num_replicas": num_replicas}
    if autoscale:
        scaling = {"autoscaling_config": {"min_replicas": 1, "max_replicas": num_replicas,
                                          "target_ongoing_requests": 32}}
    engine = serve.deployment(EngineReplica, name="engine").options(
        ray_actor_options={"num_gpus": reservations.engine_gpus,
                           "num_cpus": reservations.engine_cpus},
        max_ongoing_requests=cfg.batching.queue_capacity, **scaling)
    ingress = serve.deployment(Ingress, name="ingress").options(
        ray_actor_options={"num_cpus": reservations.ingress_cpus},
        max_ongoing_requests=cfg.server.max_pending_requests)
    return ingress.bind(engine.bind(cfg_dict, graph_ref), cfg_dict, graph.num_nodes)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="YAML config (default: $QUIVER_SERVE_CONFIG "
                                                   "or the embedded default)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="engine replicas (one GPU each where the cluster has GPUs, else a "
                         "share of its CPUs; default 2), or with --partitions P > 1 replicas "
                         "of each partition server (default 1)")
    ap.add_argument("--autoscale", action="store_true", help="1..--replicas on ongoing requests")
    ap.add_argument("--partitions", type=int, default=1,
                    help="partitions of the graph, one partition server each per replica "
                         "(1: every replica holds the whole graph)")
    ap.add_argument("--ingress-replicas", type=int, default=1,
                    help="with --partitions: replicas of the ingress (front-ends), each "
                         "reserving the ingress's CPU share")
    ap.add_argument("--partition-dir", default=None,
                    help="the partitions' folder (python -m quiver_serve.partition --out); "
                         "default: partition the config's graph now (its partition: section)")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    ap.add_argument("--host", default=None, help="HTTP bind address (default: server.host)")
    ap.add_argument("--port", type=int, default=None, help="HTTP port (default: server.port)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0,
                    help="the replicas must be placed and answering within this many seconds")
    args = ap.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1 if args.partitions > 1 else 2
    return args


def start(args: argparse.Namespace, cfg: ServeConfig) -> str:
    """Ray, the application and a first answer; returns the URL it serves on (StartError, with
    what is missing, when it cannot)."""
    import ray

    from quiver_serve.frontend.listen import check_port_free
    from quiver_serve.graph.datasets import load_graph

    host, port = args.host or cfg.server.host, args.port or cfg.server.port
    try:
        check_port_free(host, port)
    except OSError as exc:
        raise StartError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from exc
    end = time.monotonic() + args.start_timeout_s
    # "local": a new instance, never one that Ray's session files name (an old or a foreign one)
    ray.init(address=args.address or "local", include_dashboard=False)
    if args.partitions > 1:
        app = partitioned_app(args, cfg, max(1.0, end - time.monotonic()))
        serve.start(http_options={"host": host, "port": port})
    else:
        reservations = size_replicas(ray.cluster_resources(), args.replicas)
        log.info("each engine replica reserves %g CPU and %g GPU; the ingress %g CPU",
                 reservations.engine_cpus, reservations.engine_gpus, reservations.ingress_cpus)
        serve.start(http_options={"host": host, "port": port})
        app = build_app(cfg, load_graph(cfg.graph), args.replicas, autoscale=args.autoscale,
                        reservations=reservations)
    serve._run(app, _blocking=False, name=APP_NAME, route_prefix="/")
    wait_running(lambda: serve.status().applications.get(APP_NAME),
                 max(1.0, end - time.monotonic()))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    first_answer(url, max(1.0, end - time.monotonic()))
    return url


def partitioned_app(args: argparse.Namespace, cfg: ServeConfig, timeout_s: float) -> Any:
    """The partition servers, started and answering, and the ingress application over them."""
    import ray

    from quiver_serve.scaleout.partitioned import deploy

    if args.partitions < 1 or args.ingress_replicas < 1:
        raise StartError(f"--partitions and --ingress-replicas must be at least 1, got "
                         f"{args.partitions} and {args.ingress_replicas}")
    servers = args.partitions * args.replicas
    cluster = ray.cluster_resources()
    reservations = size_replicas(cluster, servers)
    share = deploy.ingress_share(float(cluster.get("CPU", 0.0)), reservations, servers,
                                 args.ingress_replicas)
    if cluster.get("GPU", 0.0) and not reservations.engine_gpus:
        log.warning("%d partition servers and %g GPUs: the servers run on CPUs (a GPU each "
                    "needs as many GPUs as partitions x replicas)", servers, cluster["GPU"])
    log.info("%d partition servers of %g CPU and %g GPU each; %d ingress replicas of %g CPU",
             servers, reservations.engine_cpus, reservations.engine_gpus,
             args.ingress_replicas, share)
    data_dir = deploy.prepare_partitions(args.config, args.partitions, args.partition_dir)
    deployment = deploy.start_servers(cfg, data_dir, args.replicas, reservations, timeout_s)
    return deploy.ingress_app(cfg, deployment, share, args.ingress_replicas)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    logging.basicConfig(level=logging.INFO)
    cfg = ServeConfig.load(args.config)
    try:
        url = start(args, cfg)
    except StartError as exc:
        print(f"quiver-serve: {exc}", file=sys.stderr, flush=True)
        _shutdown()
        return 2
    print(f"serving on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    _shutdown()
    return 0


def _shutdown() -> None:
    import ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
