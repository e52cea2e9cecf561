"""Starting a partitioned deployment on a Ray cluster (docs/architecture.md, "Partitioned
serving"): the partitions' folders (made now when none is given), one partition server per
partition and replica placed by a placement group (SPREAD: over the cluster's nodes where it has
several), restarted by Ray from its folder when its process dies, and the ingress in front.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quiver_serve.config import ServeConfig
from quiver_serve.models.startup import start_plan
from quiver_serve.scaleout.partitioned.ingress import PartitionedIngress, book_arrays
from quiver_serve.scaleout.partitioned.peers import server_name
from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs
from quiver_serve.scaleout.ray_start import MIN_SHARE_CPUS, Reservations, StartError

log = logging.getLogger(__name__)

#: a partition server is restarted this often at most (then its partition stays down)
MAX_RESTARTS = 100


@dataclass
class Deployment:
    """The servers (``servers[p][r]``), their placement group, and the folder they map."""

    app: str
    servers: list[list[Any]]
    placement_group: Any
    data_dir: Path
    dim: int
    num_features: int = 0

    def kill(self) -> None:
        """End every server and free the placement group (for a clean shutdown or a test)."""
        import ray
        from ray.util import remove_placement_group

        for reps in self.servers:
            for server in reps:
                ray.kill(server, no_restart=True)
        remove_placement_group(self.placement_group)


def prepare_partitions(config_path: str | None, parts: int, data_dir: str | None) -> Path:
    """The partitions' folder: ``data_dir`` as ``python -m quiver_serve.partition`` wrote it
    (its partition count checked), or the config's graph partitioned now by that command's
    code (the config's ``partition:`` section) into a new temporary folder."""
    from quiver_serve.partition import cli
    from quiver_serve.partition.data import load_book

    if data_dir is not None:
        try:
            book = load_book(Path(data_dir))
        except (OSError, ValueError) as exc:  # no folder, no book, a damaged book
            raise StartError(f"--partition-dir {data_dir}: {exc}") from exc
        if book.num_parts != parts:
            raise StartError(f"{data_dir} holds {book.num_parts} partitions; --partitions "
                             f"asks for {parts}")
        return Path(data_dir)
    out = Path(tempfile.mkdtemp(prefix="quiver-partitions-")) / "parts"
    argv = ["--parts", str(parts), "--out", str(out)]
    if cli.main([*argv, "--config", config_path] if config_path else argv) != 0:
        raise StartError(f"partitioning the config's graph into {parts} parts failed (above)")
    log.info("partitioned the config's graph into %d parts in %s", parts, out)
    return out


def degree_arrays(data_dir: Path, num_parts: int) -> dict[str, np.ndarray]:
    """The whole graph's in-degree and self-loop count per global id, from every partition's
    lists (a GCN's exact mode normalises by them: ``models/served.py``)."""
    from quiver_serve.partition.data import load_book, load_partition

    book = load_book(data_dir)
    in_degree = np.zeros(book.num_nodes, np.int64)
    self_loops = np.zeros(book.num_nodes, np.int64)
    for p in range(num_parts):
        data = load_partition(data_dir, p, mmap=True, book=book)
        deg = np.diff(data.indptr)
        in_degree[data.global_ids] = deg
        target = np.repeat(data.global_ids, deg)
        np.add.at(self_loops, target[data.indices == target], 1)
    return {"in_degree": in_degree, "self_loops": self_loops}


def start_servers(cfg: ServeConfig, data_dir: Path, replicas: int, reservations: Reservations,
                  timeout_s: float) -> Deployment:
    """Every partition server, placed and answering within ``timeout_s`` (else StartError)."""
    import ray
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from quiver_serve.partition.data import load_book

    num_parts = load_book(data_dir).num_parts
    app = f"quiver-serve-{uuid.uuid4().hex[:8]}"
    bundle = {"CPU": reservations.engine_cpus}
    if reservations.engine_gpus:
        bundle["GPU"] = reservations.engine_gpus
    pg = placement_group([dict(bundle) for _ in range(num_parts * replicas)], strategy="SPREAD")
    if not _ready(pg.ready(), timeout_s):
        remove_placement_group(pg)
        raise StartError(f"{num_parts * replicas} partition servers of {bundle} could not be "
                         f"placed within {timeout_s:g} s; see `ray status`")
    degrees = None
    if start_plan(cfg).primary().pyg_class == "GCN":
        degrees = {"ref": ray.put(degree_arrays(data_dir, num_parts))}
    actor = ray.remote(PartitionServer)
    cfg_dict = cfg.model_dump(mode="json")
    servers = [[actor.options(
        name=server_name(app, p, r), max_restarts=MAX_RESTARTS, max_task_retries=0,
        num_cpus=reservations.engine_cpus, num_gpus=reservations.engine_gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, p * replicas + r),
    ).remote(cfg_dict, ServerArgs(app, str(data_dir), p, r, replicas), degrees)
        for r in range(replicas)] for p in range(num_parts)]
    deployment = Deployment(app, servers, pg, data_dir, 0)
    end = time.monotonic() + timeout_s
    try:
        infos = [ray.get(s.info.remote(), timeout=max(1.0, end - time.monotonic()))
                 for reps in servers for s in reps]
    except Exception as exc:
        deployment.kill()
        raise StartError(f"the partition servers did not start within {timeout_s:g} s "
                         f"({type(exc).__name__}: {exc})") from exc
    deployment.dim = int(infos[0]["dim"])
    deployment.num_features = int(infos[0]["features"])
    return deployment


def _ready(ref: Any, timeout_s: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)


def ingress_share(cluster_cpus: float, reservations: Reservations, servers: int,
                  ingress_replicas: int) -> float:
    """CPUs each of ``ingress_replicas`` ingress replicas reserves: the share sized for one
    (``ray_start.size_replicas``), less where the servers leave too little for all of them;
    StartError naming the CPUs needed when not even ``MIN_SHARE_CPUS`` each is left."""
    left = cluster_cpus - servers * reservations.engine_cpus
    share = min(reservations.ingress_cpus, left / ingress_replicas)
    if share < MIN_SHARE_CPUS - 1e-9:
        need = servers * reservations.engine_cpus + ingress_replicas * MIN_SHARE_CPUS
        raise StartError(f"{servers} partition servers of {reservations.engine_cpus:g} CPU and "
                         f"{ingress_replicas} ingress replicas need at least {need:g} CPUs; the "
                         f"Ray cluster has {cluster_cpus:g}")
    return int(share * 100 + 1e-9) / 100


def ingress_app(cfg: ServeConfig, deployment: Deployment, ingress_cpus: float,
                replicas: int = 1) -> Any:
    """The Ray Serve application of the ingress over ``deployment``'s servers, in ``replicas``
    replicas (Ray's proxy spreads requests over them: more front-ends where one is the limit)."""
    import ray
    from ray import serve

    from quiver_serve.partition.data import load_book

    book = {"ref": ray.put(book_arrays(load_book(deployment.data_dir)))}
    ingress = serve.deployment(PartitionedIngress, name="ingress").options(
        ray_actor_options={"num_cpus": ingress_cpus}, num_replicas=replicas,
        max_ongoing_requests=cfg.server.max_pending_requests)
    return ingress.bind(deployment.servers, book, cfg.model_dump(mode="json"), deployment.dim,
                        deployment.num_features)
