"""A start is a map (docs/architecture.md, "The living graph"; decision 0039): the graph a
daemon loaded or generated is written once as the base of version 0 in its update-log folder
(CSC, feature rows, labels: one .npy per array, each with its content hash in meta.json), so a
later start maps it and replays only the log after it, instead of loading or generating it again.
Compaction writes later bases the same way.

A base of version 0 names the source it came from (``source_stamp``): a dataset file that
changed since is refused at start-up, since the log's records were made on the old one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import torch

from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)

#: bytes of a dataset file read at each end for its stamp
STAMP_BYTES = 1 << 20
#: files of a dataset folder stamped at most
STAMP_FILES = 64
#: entries of ``indptr`` and of ``indices`` read by ``csc_key`` (strided over the whole array)
KEY_SAMPLE = 1 << 20


def csc_key(indptr: torch.Tensor, indices: torch.Tensor) -> str:
    """A cheap content key of a CSC, what derived tables (PSGS, feature placement scores) are
    cached by: its sizes, ``KEY_SAMPLE`` strided entries of each array and their last entries
    (hashing all of Reddit's 0.9 GB would take ~1 s on every start; a graph edited without
    changing its size at none of the sampled positions would not be told apart)."""
    h = hashlib.blake2b(digest_size=10)
    h.update(f"{indptr.numel()}:{indices.numel()}".encode())
    for t in (indptr, indices):
        if t.numel():
            step = max(1, t.numel() // KEY_SAMPLE)
            h.update(t[::step].contiguous().cpu().numpy().tobytes())
            h.update(t[-1:].cpu().numpy().tobytes())
    return h.hexdigest()


def source_stamp(cfg: GraphConfig) -> str:
    """What a base of version 0 came from: the graph section's source settings and, for a
    dataset on disk, each file's size and first and last MiB (a cheap content key). Settings
    that do not shape the graph (its display name, the synthetic ones of another format) are
    not part of it."""
    h = hashlib.blake2b(digest_size=12)
    synthetic = cfg.format == "synthetic"
    keyed = {k: v for k, v in cfg.model_dump().items()
             if (synthetic and k.startswith("synthetic")) or k == "format"}
    h.update(repr(sorted(keyed.items())).encode())
    if cfg.path is not None:
        root = Path(cfg.path).expanduser()
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files[:STAMP_FILES]:
            size = p.stat().st_size
            h.update(f"{p.relative_to(root) if p != root else p.name}:{size}".encode())
            with open(p, "rb") as f:
                h.update(f.read(STAMP_BYTES))
                if size > STAMP_BYTES:
                    f.seek(max(size - STAMP_BYTES, STAMP_BYTES))
                    h.update(f.read(STAMP_BYTES))
    return h.hexdigest()


def graph_arrays(graph: GraphData) -> dict[str, np.ndarray]:
    """A graph's arrays as a base holds them."""
    arrays = {"indptr": graph.indptr.numpy(), "indices": graph.indices.numpy(),
              "x": graph.x.numpy()}
    if graph.y is not None:
        arrays["y"] = graph.y.numpy()
    return arrays


def write_first_snapshot(directory: Path, graph: GraphData, stamp: str) -> bool:
    """``graph`` as the base of version 0 of the update log in ``directory``, when it has no
    base yet and no other daemon holds it; returns whether it was written."""
    return write_first_base(directory, graph_arrays(graph),
                            {"name": graph.name, "version": 0, "source": stamp}, "graph")


def write_first_base(directory: Path, arrays: dict[str, np.ndarray], meta: dict,
                     what: str) -> bool:
    """``arrays`` and ``meta`` as the base of version 0 of the update log in ``directory``
    (a first start's snapshot of ``what`` it loaded), when the folder has no base yet and no
    other daemon holds its log; returns whether it was written."""
    from quiver_serve.graph.update_log import LogLockedError, UpdateLog

    update_log = UpdateLog(directory, "always")
    try:
        update_log.open()
    except LogLockedError as exc:
        log.info("%s snapshot not written: %s", what, exc)
        return False
    try:
        if update_log.base_version is not None:
            return False
        t0 = time.perf_counter()
        update_log.write_base(0, arrays, meta)
        log.info("%s snapshot written to %s: %.2f GB in %.1f s (later starts load it)", what,
                 directory, sum(a.nbytes for a in arrays.values()) / 1e9,
                 time.perf_counter() - t0)
        return True
    finally:
        update_log.close()
