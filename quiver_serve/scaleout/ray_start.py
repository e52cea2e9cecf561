"""Starting the Ray Serve application within bounds: replicas sized to the cluster, a bounded wait
for placement, and a first answer before the command says it is serving.

Ray places an actor only where its whole reservation fits, and waits for room forever ("has 1
replicas that have taken more than 30s to be scheduled", printed every 30 s). So the reservations
are computed from what the cluster has before anything is deployed (or the command says exactly
what is missing and exits), and the wait for the application to run has a deadline.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: what one engine replica and the ingress reserve when the cluster has room for it
ENGINE_CPUS, INGRESS_CPUS = 1.0, 0.5
#: the smallest CPU share a replica may get (below it, scheduling would starve it)
MIN_SHARE_CPUS = 0.1
#: the ingress's share of a cluster too small for the full reservations
INGRESS_FRACTION = 0.2


class StartError(RuntimeError):
    """The application cannot start here; the message says why and what would be needed."""


@dataclass(frozen=True)
class Reservations:
    engine_cpus: float
    engine_gpus: float
    ingress_cpus: float


def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def size_replicas(cluster: dict[str, float], replicas: int,
                  gpus_per_replica: float | None = None) -> Reservations:
    """The reservations of ``replicas`` engine replicas and one ingress that fit ``cluster``
    (Ray's ``cluster_resources()``): the full ones where there is room, else a fair share of the
    CPUs; a GPU each where the cluster has GPUs (``gpus_per_replica`` overrides)."""
    if replicas < 1:
        raise StartError(f"--replicas must be at least 1, got {replicas}")
    cpus, gpus = float(cluster.get("CPU", 0.0)), float(cluster.get("GPU", 0.0))
    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if gpus >= replicas else 0.0
    if gpus_per_replica * replicas > gpus + 1e-9:
        raise StartError(f"{replicas} replicas of {gpus_per_replica:g} GPU need "
                         f"{gpus_per_replica * replicas:g} GPUs; the Ray cluster has {gpus:g}")
    if cpus >= replicas * ENGINE_CPUS + INGRESS_CPUS:
        return Reservations(ENGINE_CPUS, gpus_per_replica, INGRESS_CPUS)
    ingress = _floor2(min(INGRESS_CPUS, cpus * INGRESS_FRACTION))
    engine = _floor2((cpus - ingress) / replicas)
    if engine < MIN_SHARE_CPUS or ingress < MIN_SHARE_CPUS:
        need = replicas * MIN_SHARE_CPUS + MIN_SHARE_CPUS
        raise StartError(f"{replicas} replicas and the ingress need at least {need:g} CPUs "
                         f"({MIN_SHARE_CPUS:g} each); the Ray cluster has {cpus:g}")
    return Reservations(min(engine, ENGINE_CPUS), gpus_per_replica, ingress)


def wait_running(status_of: Callable[[], Any], timeout_s: float, poll_s: float = 0.5) -> None:
    """Until the application's status is RUNNING; a failed deploy, or no RUNNING within
    ``timeout_s``, raises :class:`StartError` with Ray's own message."""
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        app = status_of()
        if app is not None:
            last = app
            status = str(getattr(app.status, "value", app.status))
            if status == "RUNNING":
                return
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise StartError(f"the Ray Serve application failed to deploy: {app.message}")
        time.sleep(poll_s)
    detail = f" (status {last.status}: {last.message})" if last is not None else ""
    raise StartError(f"the replicas were not placed and running within {timeout_s:g} s{detail}; "
                     "see `ray status` for what the cluster lacks")


def first_answer(url: str, timeout_s: float, poll_s: float = 0.5) -> list[list[float]]:
    """POST ``/v1/embed`` for node 0 until it answers 200 (Ray's proxy may route a moment after
    the application runs); :class:`StartError` if it never does within ``timeout_s``."""
    body = json.dumps({"node_ids": [0]}).encode()
    end = time.monotonic() + timeout_s
    error = "no answer"
    while time.monotonic() < end:
        req = urllib.request.Request(f"{url}/v1/embed", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=max(1.0, end - time.monotonic())) as resp:
                return json.loads(resp.read())["embeddings"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        time.sleep(poll_s)
    raise StartError(f"{url}/v1/embed gave no answer within {timeout_s:g} s ({error})")
