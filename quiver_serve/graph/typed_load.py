"""Loaders of typed graphs: a saved PyG ``HeteroData``, an npz layout per type, ogbn-mag-shaped
synthetic, a bag-of-words graph as papers and words (``graph.words_as_nodes``), and any
homogeneous graph as the one-type case (docs/architecture.md, "Typed graphs").

The npz layout (read with ``allow_pickle=False``; type names never hold ``__``):

* ``x__<type>`` [N, F] features of a node type, ``num_nodes__<type>`` (a scalar) for a type
  without features, ``y__<type>`` [N, ...] optional labels;
* ``edge_index__<src>__<rel>__<dst>`` [2, E] (row 0 sources, row 1 targets, as in PyG) and
  optionally ``edge_attr__<src>__<rel>__<dst>`` [E, D].

Types appear in the order of their first key in the archive, as :func:`save_typed_npz` writes them.
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import GraphConfig, resolve_path
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.typed import NAME_JOINER, EdgeType, Relation, TypedGraph, add_reverse_edges

log = logging.getLogger(__name__)

_NODE_KEYS = ("x", "num_nodes", "y")
_EDGE_KEYS = ("edge_index", "edge_attr")


def load_typed_graph(cfg: GraphConfig) -> TypedGraph:
    """The typed graph ``cfg`` names: ``synthetic`` with a typed preset (``mag``), ``pyg``
    holding a ``HeteroData``, ``npz`` in the typed layout; any other graph the homogeneous loader
    reads becomes the one-type case. ``graph.add_reverse_edges`` then adds ``rev_`` relations."""
    from quiver_serve.graph.typed_synthetic import TYPED_PRESETS, generate_typed_synthetic

    t0 = time.perf_counter()
    graph: TypedGraph | None = None
    if cfg.format == "synthetic" and cfg.synthetic_preset in TYPED_PRESETS:
        graph = generate_typed_synthetic(cfg.synthetic_preset, cfg.synthetic_scale,
                                         cfg.synthetic_seed)
    elif cfg.format in ("pyg", "npz"):
        graph = _typed_file(cfg)
    if graph is None:
        from quiver_serve.graph.datasets import load_graph

        plain = load_graph(cfg)
        graph = words_as_nodes(plain) if cfg.words_as_nodes else TypedGraph.from_graph_data(plain)
    elif cfg.words_as_nodes:
        raise ValueError("graph.words_as_nodes applies to a one-type graph with bag-of-words "
                         f"features; {graph.name} is already typed")
    if cfg.add_reverse_edges:
        graph = add_reverse_edges(graph)
    log.info("typed graph %s in %.2f s", graph.describe(), time.perf_counter() - t0)
    return graph


def _typed_file(cfg: GraphConfig) -> TypedGraph | None:
    """The typed graph in ``graph.path``, or None when the file holds a homogeneous graph."""
    if cfg.path is None:
        raise ValueError(f"graph.path is required for format {cfg.format!r}")
    path = resolve_path(cfg.path)
    if not path.exists():
        raise FileNotFoundError(f"graph.path {path} does not exist")
    if cfg.format == "npz":
        with np.load(path, allow_pickle=False) as archive:
            typed = any(k.startswith("edge_index" + NAME_JOINER) for k in archive.files)
        return load_typed_npz(path, cfg.name) if typed else None
    obj = _torch_load(path)
    return hetero_from_saved(obj, path, cfg.name) if _looks_hetero(obj) else None


def holds_typed_graph(cfg: GraphConfig) -> bool:
    """Whether ``graph.path`` (format ``pyg`` or ``npz``) holds a typed graph: an npz with
    ``edge_index__<src>__<rel>__<dst>`` keys, a saved ``HeteroData`` (or its ``to_dict()``)."""
    if cfg.format not in ("pyg", "npz") or cfg.path is None:
        return False
    path = resolve_path(cfg.path)
    if not path.exists():
        return False
    if cfg.format == "npz":
        with np.load(path, allow_pickle=False) as archive:
            return any(k.startswith("edge_index" + NAME_JOINER) for k in archive.files)
    try:
        return _looks_hetero(_torch_load(path))
    except ValueError:
        return False  # the homogeneous loader names what is wrong with the file


def _looks_hetero(obj: object) -> bool:
    from torch_geometric.data import HeteroData

    return isinstance(obj, HeteroData) or (
        isinstance(obj, dict) and any(isinstance(k, tuple) and len(k) == 3 for k in obj))


def words_as_nodes(graph: GraphData) -> TypedGraph:
    """A bag-of-words graph (Cora) as two types: ``paper`` (the nodes, their features and
    labels; ``paper-cites-paper`` their edges) and ``word`` (one per feature column, no
    features); ``paper-has_word-word`` for every nonzero feature, ordered by paper then word."""
    papers, words = graph.x.nonzero(as_tuple=True)
    cites = ("paper", "cites", "paper")
    has_word = ("paper", "has_word", "word")
    num_words = graph.num_features
    relations = {
        cites: Relation(cites, graph.indptr, graph.indices),
        has_word: Relation.from_edge_index(has_word, torch.stack([papers, words]),
                                           graph.num_nodes, num_words),
    }
    y = {} if graph.y is None else {"paper": graph.y}
    return TypedGraph(f"{graph.name}-words", {"paper": graph.num_nodes, "word": num_words},
                      {"paper": graph.x}, relations, y)


# ---- saved HeteroData ---------------------------------------------------------------------------
def _safe_globals() -> list[Any]:
    """The classes ``torch.save`` of a PyG ``HeteroData`` or ``Data`` pickles in PyG 2.x; none
    runs code on load."""
    from torch_geometric.data import Data, HeteroData
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import BaseStorage, EdgeStorage, GlobalStorage, NodeStorage

    return [HeteroData, BaseStorage, NodeStorage, EdgeStorage, Data, DataEdgeAttr,
            DataTensorAttr, GlobalStorage]


def _torch_load(path: Path) -> object:
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path}: refused: the file pickles objects other than tensors and PyG HeteroData "
            f"(it is loaded with weights_only=True, so no code in it runs); save the graph with "
            f"torch.save(data) or torch.save(data.to_dict()): {exc}") from exc
    except (OSError, RuntimeError, EOFError) as exc:
        raise ValueError(f"{path}: not a file written by torch.save: {exc}") from exc


def load_hetero_pyg(path: Path, name: str) -> TypedGraph:
    """``torch.save(data)`` or ``torch.save(data.to_dict())`` of a PyG ``HeteroData``, loaded
    weights-only: a file that pickles anything else is refused, never executed."""
    return hetero_from_saved(_torch_load(path), path, name)


def hetero_from_saved(obj: object, path: Path, name: str) -> TypedGraph:
    """The typed graph of a loaded ``HeteroData`` or its ``to_dict()``; errors name ``path``."""
    from torch_geometric.data import HeteroData

    if isinstance(obj, dict):
        if not _looks_hetero(obj):
            raise ValueError(f"{path}: a dict without (src, rel, dst) keys is not a "
                             "HeteroData.to_dict()")
        obj = HeteroData.from_dict(obj)
    if not isinstance(obj, HeteroData):
        raise ValueError(f"{path}: expected a PyG HeteroData or its to_dict(), found "
                         f"{type(obj).__name__}")
    try:
        return TypedGraph.from_hetero_data(obj, name)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


# ---- npz ------------------------------------------------------------------------------------------
def load_typed_npz(path: Path, name: str) -> TypedGraph:
    """Read the npz layout of the module docstring; errors name the file and the key."""
    with np.load(path, allow_pickle=False) as archive:
        nodes: dict[str, dict[str, Tensor]] = {}
        edges: dict[EdgeType, dict[str, Tensor]] = {}
        for key in archive.files:
            kind, _, rest = key.partition(NAME_JOINER)
            parts = rest.split(NAME_JOINER)
            if kind in _NODE_KEYS and len(parts) == 1 and parts[0]:
                nodes.setdefault(parts[0], {})[kind] = torch.from_numpy(archive[key])
            elif kind in _EDGE_KEYS and len(parts) == 3 and all(parts):
                edges.setdefault(tuple(parts), {})[kind] = torch.from_numpy(archive[key])  # type: ignore[index]
            else:
                raise ValueError(f"{path}: key {key!r} is none of x__<type>, num_nodes__<type>, "
                                 "y__<type>, edge_index__<src>__<rel>__<dst>, "
                                 "edge_attr__<src>__<rel>__<dst>")
    num_nodes, xs, ys = {}, {}, {}
    for t, arrays in nodes.items():
        if "x" in arrays:
            if arrays["x"].dim() != 2 or arrays["x"].dtype == torch.bool:
                raise ValueError(f"{path}: x__{t} must be a numeric [N, F] array, got "
                                 f"{tuple(arrays['x'].shape)} {arrays['x'].dtype}")
            xs[t] = arrays["x"].to(torch.float32)
            num_nodes[t] = xs[t].size(0)
        elif "num_nodes" in arrays and arrays["num_nodes"].numel() == 1:
            num_nodes[t] = int(arrays["num_nodes"].reshape(()))
        else:
            raise ValueError(f"{path}: node type {t!r} needs x__{t} or a scalar num_nodes__{t}")
        if "y" in arrays:
            ys[t] = arrays["y"] if arrays["y"].is_floating_point() else arrays["y"].to(torch.int64)
    relations = {}
    for et, arrays in edges.items():
        if "edge_index" not in arrays:
            raise ValueError(f"{path}: edge_attr__{NAME_JOINER.join(et)} has no edge_index")
        missing = [t for t in (et[0], et[2]) if t not in num_nodes]
        if missing:
            raise ValueError(f"{path}: edge type {list(et)} names node type {missing[0]!r}, "
                             "which has no x__ or num_nodes__ key")
        try:
            relations[et] = Relation.from_edge_index(et, arrays["edge_index"], num_nodes[et[0]],
                                                     num_nodes[et[2]], arrays.get("edge_attr"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return TypedGraph(name, num_nodes, xs, relations, ys)


def save_typed_npz(graph: TypedGraph, path: Path) -> None:
    """Write ``graph`` in the npz layout :func:`load_typed_npz` reads."""
    arrays: dict[str, np.ndarray] = {}
    for t, count in graph.num_nodes.items():
        if t in graph.x:
            arrays[f"x__{t}"] = graph.x[t].numpy()
        else:
            arrays[f"num_nodes__{t}"] = np.asarray(count, dtype=np.int64)
        if t in graph.y:
            arrays[f"y__{t}"] = graph.y[t].numpy()
    for et, rel in graph.relations.items():
        joined = NAME_JOINER.join(et)
        arrays[f"edge_index__{joined}"] = rel.edge_index().numpy()
        if rel.edge_attr is not None:
            arrays[f"edge_attr__{joined}"] = rel.edge_attr.numpy()
    np.savez(path, **arrays)  # type: ignore[arg-type]
