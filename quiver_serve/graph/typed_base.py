"""A typed graph as the base of its update log (docs/architecture.md, "Typed graphs";
docs/decisions/0059-typed-compaction.md).

Compaction writes the typed graph at a version as a base of the log's folder (the files and
crash-safe steps of ``update_log.write_base``) and drops the log it covers; a start loads the
dataset (its description is checked against the log's, ``typed_living.check_log_meta``), then
the newest typed base in the folder, then replays only the records after it.

Arrays are named by position (types and relations keep their positions: records name them so):
``x_<i>`` and ``y_<i>`` for node type ``i``, ``indptr_<k>``, ``indices_<k>``, ``edge_id_<k>`` and
``edge_attr_<k>`` for relation ``k``. ``meta`` holds ``kind: typed``, the name, the node types with
their counts and the relations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from quiver_serve import errors
from quiver_serve.graph.typed import EdgeType, Relation, TypedGraph

KIND = "typed"


def is_typed(meta: dict[str, Any]) -> bool:
    return meta.get("kind") == KIND


def base_arrays(graph: TypedGraph) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The files of ``graph``'s base and its meta. Labels of nodes added since the dataset are
    -1."""
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
    meta = {"kind": KIND, "name": graph.name,
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
                    like: TypedGraph, where: Path) -> TypedGraph:
    """The typed graph of a base (copied out of the mapped files: a live graph writes feature
    rows in place); its types and relations must be ``like``'s, the dataset's."""
    node_types = [t for t, _ in meta["num_nodes"]]
    edge_types: list[EdgeType] = [tuple(et) for et in meta["edge_types"]]  # type: ignore[misc]
    if node_types != like.node_types or edge_types != like.edge_types:
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
    return TypedGraph(str(meta.get("name", like.name)), num_nodes, x, relations, y)  # type: ignore[arg-type]


def newest_base(directory: Path, like: TypedGraph) -> tuple[TypedGraph, int]:
    """The newest typed base in the update-log folder and its version, else ``like`` (the
    dataset) at version 0. A folder whose base is not typed is refused by name."""
    from quiver_serve.graph.update_log import load_base

    found = load_base(directory) if Path(directory).exists() else None
    if found is None:
        return like, 0
    version, arrays, meta = found
    if not is_typed(meta):
        raise errors.ServeError(
            "dataset_changed", f"the update-log folder {directory} holds the base of a graph of "
            "one type; this config serves a typed graph: point graph.update_log_dir elsewhere",
            500)
    return graph_from_base(arrays, meta, like, Path(directory)), version
