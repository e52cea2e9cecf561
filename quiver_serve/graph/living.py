"""The living graph's rules: capacities, where its log lives, what an update may contain.

Every process that applies updates builds its overlay with :func:`capacities` of the same config and
base, so an update that fits one overlay fits all of them, and validation here (once, by the
writer) means every record in the log applies everywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quiver_serve import envs, errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.log_reader import load_base

#: the least node headroom (ids and feature rows preallocated for appended nodes)
MIN_NEW_NODES = 1024
#: the least overlay, in entries
MIN_OVERLAY_ENTRIES = 1 << 20

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacities:
    node_capacity: int  # highest node count while this base serves
    edge_capacity: int  # overlay entries


def capacities(cfg: GraphConfig, base_nodes: int, base_edges: int) -> Capacities:
    new_nodes = cfg.max_new_nodes if cfg.max_new_nodes is not None else max(
        MIN_NEW_NODES, base_nodes // 10)
    entries = cfg.overlay_capacity_edges if cfg.overlay_capacity_edges is not None else max(
        MIN_OVERLAY_ENTRIES, base_edges // 4)
    return Capacities(base_nodes + new_nodes, entries)


#: the meta ``kind`` of a typed base (``graph/typed_base.py``, which imports this module)
TYPED_BASE_KIND = "typed"
#: settings that make a dataset another (typed) graph: part of the folder's key when set
TYPED_KEY_FIELDS = ("words_as_nodes", "add_reverse_edges")


def log_dir(cfg: GraphConfig) -> Path:
    """``graph.update_log_dir``, or a folder keyed by the dataset's config (not its content,
    which compaction changes) under ``$QUIVER_SERVE_GRAPH_STATE``. The typed settings of
    ``TYPED_KEY_FIELDS`` join the key when set, so Cora and Cora served as a typed graph get
    folders of their own; a typed graph whose log is already in the folder of the key without
    them (written before they were keyed) stays there."""
    if cfg.update_log_dir is not None:
        return Path(cfg.update_log_dir).expanduser()
    keyed = {k: v for k, v in cfg.model_dump().items()
             if k.startswith("synthetic") or k in ("format", "path", "name")}
    if cfg.path is not None:
        keyed["path"] = str(Path(cfg.path).expanduser().resolve())
    legacy = _keyed_folder(cfg.name, keyed)
    typed = {k: getattr(cfg, k) for k in TYPED_KEY_FIELDS if getattr(cfg, k)}
    if not typed:
        return legacy
    folder = _keyed_folder(cfg.name, {**keyed, **typed})
    if not folder.exists() and _holds_typed_base(legacy):
        return legacy
    return folder


def _keyed_folder(name: str, keyed: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    return envs.QUIVER_SERVE_GRAPH_STATE / f"{name}-{digest}"


def _holds_typed_base(folder: Path) -> bool:
    try:
        found = load_base(folder) if folder.exists() else None
    except (OSError, ValueError):
        return False
    return found is not None and found[2].get("kind") == TYPED_BASE_KIND


def log_dir_for_graph(graph: GraphData) -> Path:
    """The default update-log folder of a graph handed in by a caller (not loaded from the
    config): keyed by its content, so another graph never replays its log."""
    h = hashlib.sha1(f"{graph.num_nodes}:{graph.num_edges}:{graph.num_features}".encode())
    step = max(1, graph.num_edges // 4096)
    h.update(graph.indices[::step].numpy().tobytes())
    h.update(graph.indptr[::max(1, graph.num_nodes // 4096)].numpy().tobytes())
    h.update(graph.x[::max(1, graph.num_nodes // 64)].numpy().tobytes())
    return envs.QUIVER_SERVE_GRAPH_STATE / f"{graph.name}-g{h.hexdigest()[:12]}"


def _bad(code: str, message: str, status: int = 400) -> errors.ServeError:
    return errors.ServeError(code, message, status)


def as_pairs(value: object, field: str) -> np.ndarray:
    """``[[src, dst], ...]`` as int64 [n, 2], or a 422 naming the field."""
    try:
        arr = np.asarray(value if value is not None else [], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise _bad("invalid_edges", f"{field} must be a list of [src, dst] integer pairs",
                   422) from None
    if arr.size == 0:
        return np.empty((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise _bad("invalid_edges", f"{field} must be a list of [src, dst] pairs, got shape "
                   f"{tuple(arr.shape)}", 422)
    return arr


def as_rows(value: object, field: str, width: int) -> np.ndarray:
    """Feature rows as float32 [n, width], finite, or a 4xx naming the field."""
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise _bad("invalid_features", f"{field} must be a list of rows of numbers", 422) from None
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise _bad("invalid_features", f"{field} must be a non-empty list of rows, got shape "
                   f"{tuple(arr.shape)}", 422)
    if arr.shape[1] != width:
        raise _bad("invalid_features", f"{field} rows have {arr.shape[1]} values; this graph's "
                   f"features have {width}", 422)
    if not np.isfinite(arr).all():
        row = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
        raise _bad("invalid_features", f"{field} row {row} has a NaN or infinite value")
    return np.ascontiguousarray(arr)


def check_ids(ids: np.ndarray, num_nodes: int, field: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_nodes):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise _bad("invalid_node_ids", f"{field}: node id {bad} is out of range: valid ids are "
                   f"0..{num_nodes - 1}")


def feature_writes(node_ids: object, features: object, width: int, limit: int,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A feature write's body checked: (int64 ids, float32 rows [n, width]), one row per id,
    at most ``limit`` rows; a named 422 otherwise."""
    try:
        ids = np.asarray(node_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise _bad("invalid_node_ids", "node_ids must be a list of integers", 422) from None
    rows = as_rows(features, "features", width)
    if ids.size != len(rows):
        raise _bad("invalid_features", f"{ids.size} node_ids but {len(rows)} feature rows", 422)
    check_count(len(rows), limit, "feature rows")
    return ids, rows


def check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise _bad("too_many_updates", f"{n} {what} in one call; the limit is {limit} "
                   "(graph.max_update_edges)", 413)


def overlay_full(message: str, retry_after_s: int) -> errors.ServeError:
    err = errors.ServeError("overlay_full", f"{message}; retry after compaction", 503)
    err.retry_after_s = retry_after_s  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class LiveGraphArgs:
    """What a spawned process needs to follow the living graph (picklable: the state tensor is
    shared memory)."""

    log_dir: str
    base_version: int
    caps: Capacities
    state: Any  # torch.Tensor of ``GraphState``


def load_serving_graph(cfg: GraphConfig) -> tuple[GraphData, int]:
    """The graph to serve and its version: the newest base in the update-log folder (a
    compacted one, or the snapshot of the dataset a first start wrote: ``snapshot.py``), else
    the dataset loaded or generated (version 0), then snapshotted when ``graph.snapshot``."""
    from quiver_serve.graph.datasets import load_graph
    from quiver_serve.graph.snapshot import source_stamp, write_first_snapshot
    from quiver_serve.graph.update_log import load_base

    directory = log_dir(cfg)
    found = load_base(directory) if directory.exists() else None
    stamp = source_stamp(cfg)
    if found is None:
        graph = load_graph(cfg)
        if cfg.snapshot:
            write_first_snapshot(directory, graph, stamp)
        return graph, 0
    version, arrays, meta = found
    if version == 0 and meta.get("source") not in (None, stamp):
        raise errors.ServeError(
            "dataset_changed", f"the dataset of graph.path changed since the update log in "
            f"{directory} was started from it (its records name the old graph's ids): move "
            "that folder away to start over, or point graph.update_log_dir elsewhere", 500)
    log.info("graph mapped from the base of version %d in %s", version, directory)
    # mapped, not copied: every process maps the same files (``MappedGraph``)
    return graph_from_arrays(arrays, meta, cfg.name, mapped_from=directory), version


@dataclass(frozen=True)
class MappedGraph:
    """A graph mapped from the base in force of an update-log folder, as a process is handed
    it: the folder, not the arrays, so each process maps the same files and the page cache
    holds the one copy (a restart costs no copy of the graph into shared memory). A child
    started after a compaction maps the newer base; its ``newest_base`` call then moves its
    ``LiveGraphArgs`` onto that base's version."""

    log_dir: str
    name: str

    def open(self) -> GraphData:
        from quiver_serve.graph.update_log import load_base

        found = load_base(Path(self.log_dir))
        if found is None:
            raise FileNotFoundError(f"no graph base in {self.log_dir}: the folder the daemon "
                                    "started from was removed while it runs")
        _version, arrays, meta = found
        return graph_from_arrays(arrays, meta, self.name, mapped_from=Path(self.log_dir))


def handed(graph: GraphData) -> GraphData | MappedGraph:
    """What a child process is given for ``graph``: its folder when it is mapped."""
    return MappedGraph(graph.mapped_from, graph.name) if graph.mapped_from else graph


def received(graph: GraphData | MappedGraph) -> GraphData:
    """The graph a child process was given (``handed``)."""
    return graph.open() if isinstance(graph, MappedGraph) else graph


def graph_from_arrays(arrays: dict[str, np.ndarray], meta: dict, name: str = "graph",
                      copy: bool = False, with_x: bool = True,
                      mapped_from: Path | None = None) -> GraphData:
    """A compacted base as a GraphData: copied into memory, or (``copy=False``) over the files'
    read-only mappings, which every process that maps them shares through the page cache
    (``mapped_from``: the update-log folder of that base in force, for ``MappedGraph``)."""
    def tensor(arr: np.ndarray) -> torch.Tensor:
        if copy:
            return torch.from_numpy(np.array(arr))
        with warnings.catch_warnings():  # read-only: nothing writes a base's arrays
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)

    indptr = tensor(arrays["indptr"])
    x = tensor(arrays["x"]) if with_x else torch.empty((indptr.numel() - 1, 0))
    y = tensor(arrays["y"]) if with_x and "y" in arrays else None
    graph = GraphData(str(meta.get("name", name)), indptr, tensor(arrays["indices"]), x, y)
    if mapped_from is not None and not copy and with_x:
        graph.mapped_from = str(mapped_from)
    return graph


def newest_base(live: LiveGraphArgs, graph: GraphData, with_x: bool = True, copy: bool = False,
                ) -> tuple[GraphData, LiveGraphArgs]:
    """The newest compacted base when the writer made one after ``live``'s (a process started
    or restarted after a compaction samples over it), else ``graph`` and ``live`` as given.
    ``copy``: into private memory (a GPU sampler pins or copies it), else mapped read-only."""
    from quiver_serve.graph.update_log import load_base

    found = load_base(Path(live.log_dir))  # CURRENT, not the slot: it may be mid-compaction
    if found is None or found[0] <= live.base_version:
        return graph, live
    version, arrays, meta = found
    newer = LiveGraphArgs(live.log_dir, version, live.caps, live.state)
    return graph_from_arrays(arrays, meta, graph.name, copy=copy, with_x=with_x), newer
