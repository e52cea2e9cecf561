"""Dataset loaders: Planetoid raw folders, .npz, saved PyG ``Data``, synthetic power-law graphs."""

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

log = logging.getLogger(__name__)


def load_graph(cfg: GraphConfig) -> GraphData:
    """Load the graph a config names, logging what was loaded and how long it took."""
    t0 = time.perf_counter()
    log.info("loading graph: format=%s path=%s", cfg.format, cfg.path)
    if cfg.format == "synthetic":
        from quiver_serve.graph.synthetic import generate_synthetic

        graph = generate_synthetic(cfg)
    else:
        if cfg.path is None:
            raise ValueError(f"graph.path is required for format {cfg.format!r}")
        path = resolve_path(cfg.path)
        if not path.exists():
            raise FileNotFoundError(f"graph.path {path} does not exist")
        loader = {"planetoid": load_planetoid_raw, "npz": load_npz, "pyg": load_pyg_data}[cfg.format]
        graph = loader(path, cfg.name)
    log.info("loaded %s in %.2f s", graph.describe(), time.perf_counter() - t0)
    return graph


def load_planetoid_raw(raw_dir: Path, name: str) -> GraphData:
    """Read a Planetoid ``raw/`` folder (``ind.<name>.*``) as PyG's ``Planetoid`` does, but with
    a restricted unpickler (``graph/planetoid.py``): a file that names anything but arrays,
    sparse matrices and lists is refused, never run."""
    from quiver_serve.graph.planetoid import read_planetoid

    prefix = name.lower()
    missing = [s for s in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
               if not (raw_dir / f"ind.{prefix}.{s}").exists()]
    if missing:
        raise FileNotFoundError(f"{raw_dir} lacks Planetoid files for {name!r}: {missing}")
    x, edge_index, y = read_planetoid(raw_dir, prefix)
    return GraphData.from_edge_index(edge_index, x, name=prefix, y=y)


# --- .npz ----------------------------------------------------------------------------------------

_FEATURE_KEYS = ("x", "features", "node_features")
_LABEL_KEYS = ("y", "labels", "node_labels")


def load_npz(path: Path, name: str) -> GraphData:
    """Read a graph from an ``.npz`` archive; errors name the file and the key.

    Read with ``np.load(path, allow_pickle=False)``: object arrays are refused. Keys:

    - features ``x`` | ``features`` | ``node_features``: numeric [N, F], made float32 (required;
      its rows define the N nodes);
    - labels ``y`` | ``labels`` | ``node_labels``: [N, ...] (optional; integers become int64);
    - and one graph layout, tried in this order:

      - ``indptr`` [N + 1] + ``indices`` [E] (CSC): the IN-neighbours (sources) of node v are
        ``indices[indptr[v]:indptr[v+1]]``, the orientation of GraphData and PyG's NeighborLoader.
        Not scipy's CSR of an adjacency matrix A[src, dst], which lists out-neighbours.
        Neighbour lists are sorted by id if they are not already.
      - ``edge_index`` [2, E]: row 0 sources, row 1 targets, as in PyG; kept as given (directed,
        duplicates kept).
      - ``edges`` [E, 2]: the yandex-research heterophilous-graphs format. Made undirected and
        coalesced with PyG's ``to_undirected``, exactly as ``HeterophilousGraphDataset`` does, so
        the graph served is the one a PyG user trains on.
    """
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable .npz archive: {exc}") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: expected an .npz archive of named arrays, found a single array")
    with archive:
        keys = set(archive.files)
        x = _npz_features(archive, keys, path)
        y = _npz_labels(archive, keys, path, x.size(0))
        if "indptr" in keys or "indices" in keys:
            return _npz_csc(archive, keys, path, name, x, y)
        if "edge_index" in keys:
            edge_index = _npz_int(archive, "edge_index", path)
            if edge_index.dim() != 2 or edge_index.size(0) != 2:
                raise ValueError(
                    f"{path}: key 'edge_index' must have shape [2, E] (sources, targets), "
                    f"got {tuple(edge_index.shape)}; an [E, 2] list goes under 'edges'"
                )
            return _graph_from_edges(edge_index, x, y, path, name)
        if "edges" in keys:
            edges = _npz_int(archive, "edges", path)
            if edges.dim() != 2 or edges.size(1) != 2:
                raise ValueError(
                    f"{path}: key 'edges' must have shape [E, 2], got {tuple(edges.shape)}"
                )
            from torch_geometric.utils import to_undirected

            _check_node_range(edges, x.size(0), path, "edges")
            edge_index = to_undirected(edges.t().contiguous(), num_nodes=x.size(0))
            return _graph_from_edges(edge_index, x, y, path, name)
    raise ValueError(
        f"{path}: no graph found: expected 'indptr' + 'indices' (CSC), 'edge_index' [2, E] "
        f"or 'edges' [E, 2]; the archive has {sorted(keys)}"
    )


def _npz_array(archive: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as exc:  # object arrays need pickle, which is refused on purpose
        raise ValueError(f"{path}: key {key!r} cannot be read without pickle: {exc}") from exc


def _npz_int(archive: np.lib.npyio.NpzFile, key: str, path: Path) -> Tensor:
    arr = _npz_array(archive, key, path)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: key {key!r} must hold integers, got dtype {arr.dtype}")
    return torch.from_numpy(arr.astype(np.int64, copy=False))


def _npz_features(archive: np.lib.npyio.NpzFile, keys: set[str], path: Path) -> Tensor:
    key = next((k for k in _FEATURE_KEYS if k in keys), None)
    if key is None:
        raise ValueError(f"{path}: no node features: expected one of {list(_FEATURE_KEYS)}, "
                         f"the archive has {sorted(keys)}")
    arr = _npz_array(archive, key, path)
    if arr.ndim != 2 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{path}: key {key!r} must be a numeric [N, F] array, "
                         f"got shape {arr.shape} dtype {arr.dtype}")
    return torch.from_numpy(arr.astype(np.float32, copy=False)).contiguous()


def _npz_labels(
    archive: np.lib.npyio.NpzFile, keys: set[str], path: Path, num_nodes: int
) -> Tensor | None:
    key = next((k for k in _LABEL_KEYS if k in keys), None)
    if key is None:
        return None
    arr = _npz_array(archive, key, path)
    if arr.ndim < 1 or arr.shape[0] != num_nodes:
        raise ValueError(
            f"{path}: key {key!r} must have one row per node ({num_nodes}), got shape {arr.shape}"
        )
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        return torch.from_numpy(arr.astype(np.int64, copy=False))
    return torch.from_numpy(arr.astype(np.float32, copy=False))  # soft or multi-label targets


def _npz_csc(archive: np.lib.npyio.NpzFile, keys: set[str], path: Path, name: str,
             x: Tensor, y: Tensor | None) -> GraphData:
    for key in ("indptr", "indices"):
        if key not in keys:
            raise ValueError(
                f"{path}: CSC layout needs both 'indptr' and 'indices'; {key!r} is missing"
            )
    indptr, indices = _npz_int(archive, "indptr", path), _npz_int(archive, "indices", path)
    num_nodes = x.size(0)
    if indptr.dim() != 1 or indptr.numel() != num_nodes + 1:
        raise ValueError(f"{path}: key 'indptr' must have num_nodes + 1 = {num_nodes + 1} entries "
                         f"(one row of features per node), got shape {tuple(indptr.shape)}")
    if indices.dim() != 1:
        raise ValueError(f"{path}: key 'indices' must be 1-D, got shape {tuple(indices.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != indices.numel() or bool((indptr.diff() < 0).any()):
        raise ValueError(f"{path}: key 'indptr' must start at 0, never decrease, and end at "
                         f"len(indices) = {indices.numel()}")
    _check_node_range(indices, num_nodes, path, "indices")
    if not _sorted_within_segments(indptr, indices):
        # GraphData promises neighbour lists sorted by id; rebuilding sorts them.
        dst = torch.repeat_interleave(torch.arange(num_nodes), indptr.diff())
        return GraphData.from_edge_index(torch.stack([indices, dst]), x, name=name, y=y)
    return GraphData(name=name, indptr=indptr.contiguous(), indices=indices.contiguous(), x=x, y=y)


def _sorted_within_segments(indptr: Tensor, indices: Tensor) -> bool:
    if indices.numel() < 2:
        return True
    descending = indices[1:] < indices[:-1]
    # A decrease is fine where a new node's list starts (position indptr[v] for v >= 1).
    starts = indptr[1:-1]
    starts = starts[(starts > 0) & (starts < indices.numel())]
    descending[starts - 1] = False
    return not bool(descending.any())


def _check_node_range(ids: Tensor, num_nodes: int, path: Path, key: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_nodes):
        raise ValueError(
            f"{path}: key {key!r} holds node ids in [{int(ids.min())}, {int(ids.max())}] "
            f"but the features define {num_nodes} nodes [0, {num_nodes})"
        )


def _graph_from_edges(
    edge_index: Tensor, x: Tensor, y: Tensor | None, path: Path, name: str
) -> GraphData:
    try:
        return GraphData.from_edge_index(edge_index, x, name=name, y=y)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


# --- saved PyG Data -------------------------------------------------------------------------------


def _pyg_safe_globals() -> list[Any]:
    """The classes ``torch.save(Data)`` pickles in PyG 2.x, and nothing that runs code on load."""
    from torch_geometric.data.data import Data, DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    return [Data, DataEdgeAttr, DataTensorAttr, GlobalStorage]


def load_pyg_data(path: Path, name: str) -> GraphData:
    """Read ``torch.save(data)`` or ``torch.save(data.to_dict())`` of a PyG ``Data`` (also a
    single-graph ``InMemoryDataset`` file, ``processed/data.pt``). Loaded only with
    ``weights_only=True``: a file that pickles anything else is refused, never executed."""
    try:
        with torch.serialization.safe_globals(_pyg_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path}: refused: the file pickles objects other than tensors and PyG Data (it is "
            f"loaded with weights_only=True, so no code in it runs); save the graph with "
            f"torch.save(data) or torch.save(data.to_dict()): {exc}"
        ) from exc
    except (OSError, RuntimeError, EOFError) as exc:
        raise ValueError(f"{path}: not a file written by torch.save: {exc}") from exc
    attrs = _pyg_attributes(obj, path)
    for key in ("x", "edge_index"):
        if not isinstance(attrs.get(key), Tensor):
            raise ValueError(
                f"{path}: the saved Data needs a tensor {key!r}; it has {sorted(attrs)}"
            )
    # PyG may hand back EdgeIndex / Index subclasses; the server wants plain tensors.
    x = attrs["x"].as_subclass(Tensor)
    edge_index = attrs["edge_index"].as_subclass(Tensor)
    if x.dim() != 2:
        raise ValueError(f"{path}: 'x' must be [num_nodes, F], got {tuple(x.shape)}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
        raise ValueError(f"{path}: 'edge_index' must be an integer [2, E] tensor, got "
                         f"{tuple(edge_index.shape)} {edge_index.dtype}")
    # Labels are optional: anything that is not one row per node (e.g. a graph label) is dropped.
    y: Tensor | None = None
    labels = attrs.get("y")
    if isinstance(labels, Tensor) and labels.dim() >= 1 and labels.size(0) == x.size(0):
        y = labels.as_subclass(Tensor)
        y = y if y.is_floating_point() else y.to(torch.int64)
    return _graph_from_edges(edge_index, x, y, path, name)


def _pyg_attributes(obj: object, path: Path) -> dict:
    from torch_geometric.data import Data

    if isinstance(obj, Data):
        return obj.to_dict()
    if isinstance(obj, tuple) and len(obj) in (2, 3) and isinstance(obj[0], dict):
        slices = obj[1] if isinstance(obj[1], dict) else {}
        x_slices = slices.get("x")
        if isinstance(x_slices, Tensor) and x_slices.numel() > 2:
            raise ValueError(f"{path}: a PyG dataset file with {x_slices.numel() - 1} graphs; "
                             f"serve one graph: torch.save(dataset[i], path)")
        return obj[0]
    if isinstance(obj, dict):
        return obj
    raise ValueError(f"{path}: expected a PyG Data or its to_dict(), found {type(obj).__name__}")
