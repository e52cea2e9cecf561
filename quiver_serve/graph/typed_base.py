"""A typed graph as the base of its update log (docs/architecture.md, "Typed graphs";
docs/decisions/0059-typed-compaction.md).

Compaction writes the typed graph at a version as a base of the log's folder (the files and
crash-safe steps of ``update_log.write_base``) and drops the log it covers. A start is a map
(``typed_graph_at_start``): the first start loads or generates the dataset and writes it as the
base of version 0 (``graph.snapshot``); every later start loads the newest typed base, without
the dataset, when the base names the same source (``typed_stamp``: the source settings and
files, and the settings that shape a typed graph), and replays only the records after it.

Arrays are named by position (types and relations keep their positions: records name them so):
``x_<i>`` and ``y_<i>`` for node type ``i``, ``indptr_<k>``, ``indices_<k>``, ``edge_id_<k>`` and
``edge_attr_<k>`` for relation ``k``. ``meta`` holds ``kind: typed``, the name, the node types with
their counts and the relations.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph.living import TYPED_BASE_KIND
from quiver_serve.graph.typed import EdgeType, Relation, TypedGraph

log = logging.getLogger(__name__)

KIND = TYPED_BASE_KIND


def typed_stamp(cfg: GraphConfig) -> str:
    """What a typed base came from: ``snapshot.source_stamp`` and the settings that shape a
    typed graph from its source."""
    from quiver_serve.graph.snapshot import source_stamp

    shape = f"{source_stamp(cfg)}:{cfg.add_reverse_edges}:{cfg.words_as_nodes}"
    return hashlib.blake2b(shape.encode(), digest_size=12).hexdigest()


def is_typed(meta: dict[str, Any]) -> bool:
    return meta.get("kind") == KIND


def base_arrays(graph: TypedGraph, stamp: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The files of ``graph``'s base and its meta (``stamp``: ``typed_stamp``). Labels of nodes
    added since the dataset are -1."""
    arrays: dict[str, np.ndarray] = {}
    for i, t in enumerate(graph.node_types):
        if t in graph.x:
            arrays[f"x_{i}"] = graph.x[t].numpy()
        if t in graph.y:
            arrays[f"y_{i}"] = _labels(graph.y[t].numpy(), graph.num_nodes[t])
    for k, et in enumerate(graph.edge_types):
        rel = graph.relations[et]
        arrays[f"indptr_{k}"], arrays[f"indices_{k}"] = rel.indptr.numpy(), rel.indices.numpy()
        if rel.edge_id is not None:
            arrays[f"edge_id_{k}"] = rel.edge_id.numpy()
        if rel.edge_attr is not None:
            arrays[f"edge_attr_{k}"] = rel.edge_attr.numpy()
    meta = {"kind": KIND, "name": graph.name, "source": stamp,
            "num_nodes": [[t, graph.num_nodes[t]] for t in graph.node_types],
            "edge_types": [list(et) for et in graph.edge_types]}
    return arrays, meta


def _labels(y: np.ndarray, count: int) -> np.ndarray:
    if y.shape[0] >= count:
        return y[:count]
    out = np.full((count, *y.shape[1:]), -1, dtype=y.dtype)
    out[:y.shape[0]] = y
    return out


def graph_from_base(arrays: dict[str, np.ndarray], meta: dict[str, Any],
                    like: TypedGraph | None, where: Path) -> TypedGraph:
    """The typed graph of a base (copied out of the mapped files: a live graph writes feature
    rows in place); its types and relations must be ``like``'s, the dataset's, when given."""
    node_types = [t for t, _ in meta["num_nodes"]]
    edge_types: list[EdgeType] = [tuple(et) for et in meta["edge_types"]]  # type: ignore[misc]
    if like is not None and (node_types != like.node_types or edge_types != like.edge_types):
        raise errors.ServeError(
            "dataset_changed", f"the typed base in {where} has node types {node_types} and "
            f"relations {[list(e) for e in edge_types]}; the dataset has {like.node_types} and "
            f"{[list(e) for e in like.edge_types]}: move that folder away to start over, or "
            "point graph.update_log_dir elsewhere", 500)

    def tensor(name: str) -> torch.Tensor | None:
        return torch.from_numpy(np.array(arrays[name])) if name in arrays else None

    num_nodes = {t: int(n) for t, n in meta["num_nodes"]}
    x = {t: tensor(f"x_{i}") for i, t in enumerate(node_types) if f"x_{i}" in arrays}
    y = {t: tensor(f"y_{i}") for i, t in enumerate(node_types) if f"y_{i}" in arrays}
    relations = {et: Relation(et, tensor(f"indptr_{k}"), tensor(f"indices_{k}"),  # type: ignore[arg-type]
                              tensor(f"edge_id_{k}"), tensor(f"edge_attr_{k}"))
                 for k, et in enumerate(edge_types)}
    return TypedGraph(str(meta["name"]), num_nodes, x, relations, y)  # type: ignore[arg-type]


def newest_base(directory: Path, like: TypedGraph) -> tuple[TypedGraph, int]:
    """The newest typed base in the update-log folder and its version, else ``like`` (the
    dataset) at version 0. A folder whose base is not typed is refused by name."""
    from quiver_serve.graph.update_log import load_base

    found = load_base(directory) if Path(directory).exists() else None
    return _from_found(found, like, Path(directory))


def _from_found(found: tuple[int, dict[str, np.ndarray], dict[str, Any]] | None,
                like: TypedGraph, directory: Path) -> tuple[TypedGraph, int]:
    """``newest_base`` over a base already read (``load_base``'s answer)."""
    if found is None:
        return like, 0
    version, arrays, meta = found
    if not is_typed(meta):
        raise errors.ServeError(
            "dataset_changed", f"the update-log folder {directory} holds the base of a graph of "
            "one type; this config serves a typed graph: point graph.update_log_dir elsewhere",
            500)
    return graph_from_base(arrays, meta, like, directory), version


def typed_graph_at_start(cfg: GraphConfig, directory: Path,
                         write_snapshot: bool = False) -> tuple[TypedGraph, int]:
    """The typed graph a start serves and its version: the newest typed base of the log's
    folder when it names this config's source, loaded without the dataset; else the dataset
    (checked against the log's description), over any base written before bases named their
    source, or written as the base of version 0 when ``write_snapshot`` and ``graph.snapshot``
    (the daemon's main process; engine cores only read)."""
    from quiver_serve.graph.typed_living import TypedLiveGraph, check_log_meta
    from quiver_serve.graph.typed_load import load_typed_graph
    from quiver_serve.graph.update_log import load_base

    directory = Path(directory)
    found = load_base(directory) if directory.exists() else None
    stamp = typed_stamp(cfg)
    if found is not None and is_typed(found[2]) and found[2].get("source") is not None:
        version, arrays, meta = found
        if meta["source"] != stamp:
            raise errors.ServeError(
                "dataset_changed", f"the typed graph's source (graph.path, its synthetic or "
                f"typed settings) changed since the update log in {directory} was started from "
                "it (its records name the old graph's types and ids): move that folder away to "
                "start over, or point graph.update_log_dir elsewhere", 500)
        t0 = time.perf_counter()
        graph = graph_from_base(arrays, meta, None, directory)
        log.info("typed graph loaded from the base of version %d in %s in %.2f s", version,
                 directory, time.perf_counter() - t0)
        return graph, version
    dataset = load_typed_graph(cfg)
    check_log_meta(directory, TypedLiveGraph(dataset, cfg.add_reverse_edges).describe())
    graph, version = _from_found(found, dataset, directory)
    if version == 0 and write_snapshot and cfg.snapshot and found is None:
        from quiver_serve.graph.snapshot import write_first_base

        write_first_base(directory, *base_arrays(dataset, stamp), "typed graph")
    return graph, version
