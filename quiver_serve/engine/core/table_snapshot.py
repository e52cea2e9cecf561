"""Snapshots of the exact table (docs/architecture.md, "The exact table"; decision 0041): a start
maps the table instead of computing it when one was saved for the same model weights and the
same base graph, and marks what the log changed since, for the refresh thread.

Layout, in the graph's update-log folder::

    tables/<key>/v<version:020d>/layer<i>.npy   every layer's rows at that graph version
    tables/<key>/v<version:020d>/meta.json      written last: a folder without it is ignored

``key`` hashes the model (class and weights) and the base it was computed over (the
base's meta.json, which holds every array's content hash), so a new model version, a new base
or another graph never reads it. Writing replaces the folder of a key's older version and every
other key's (one snapshot kept per log folder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from quiver_serve.engine.core.exact_table import ExactTable, union_of
from quiver_serve.graph.base_files import byte_progress, write_array
from quiver_serve.graph.log_reader import META_NAME, read_current
from quiver_serve.graph.records import EdgeRecord, FeatureRecord, NodeRecord
from quiver_serve.graph.update_log import LogFollower
from quiver_serve.models.served import ServedModel

log = logging.getLogger(__name__)

TABLES_DIR = "tables"


def table_key(served: ServedModel, log_dir: Path) -> str | None:
    """The snapshot key of ``table`` (module docstring); None without a base on disk."""
    base = read_current(log_dir)
    if base is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update((log_dir / base / META_NAME).read_bytes())
    h.update(type(served.model).__qualname__.encode())
    for name, tensor in served.model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save(table: ExactTable, log_dir: Path, key: str, version: int, num_nodes: int) -> None:
    """Write the table's first ``num_nodes`` rows of every layer as the snapshot of ``key`` at
    ``version`` (a temporary folder renamed into place), then drop the older ones."""
    root = log_dir / TABLES_DIR
    final = root / key / f"v{version:020d}"
    tmp = root / key / f".v{version:020d}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    layers = [t[:num_nodes].cpu().numpy() for t in table.layers]
    with byte_progress(sum(a.nbytes for a in layers), "writing the exact table") as bar:
        hashes = []
        for i, arr in enumerate(layers):
            with open(tmp / f"layer{i}.npy", "wb") as f:
                hashes.append(write_array(f, arr, bar))
                f.flush()
                os.fsync(f.fileno())
    (tmp / META_NAME).write_text(json.dumps({"version": version, "num_nodes": num_nodes,
                                             "layers": hashes}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for other in root.iterdir():  # one snapshot per log folder
        if other.name != key:
            shutil.rmtree(other, ignore_errors=True)
    for old in (root / key).iterdir():
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    log.info("exact table snapshot at version %d: %.1f MiB in %.2f s", version,
             sum(a.nbytes for a in layers) / 2**20, time.perf_counter() - t0)


def find(log_dir: Path, key: str, max_version: int) -> tuple[int, list[np.ndarray]] | None:
    """The newest snapshot of ``key`` at or below ``max_version``: (version, layers mapped)."""
    folder = log_dir / TABLES_DIR / key
    if not folder.is_dir():
        return None
    for entry in sorted(folder.iterdir(), reverse=True):
        meta_path = entry / META_NAME
        if not entry.name.startswith("v") or not meta_path.exists():
            continue
        meta = json.loads(meta_path.read_text())
        if meta["version"] > max_version:
            continue
        layers = [np.load(entry / f"layer{i}.npy", mmap_mode="r", allow_pickle=False)
                  for i in range(len(meta["layers"]))]
        return int(meta["version"]), layers
    return None


def mark_since(table: ExactTable, log_dir: Path, since: int, until: int,
               num_nodes_now: int) -> int:
    """Mark the rows the log's records ``since + 1 .. until`` change (the table was taken at
    ``since``); returns how many records."""
    follower = LogFollower(log_dir, since)
    records = []
    try:
        while len(records) < until - since:
            got = follower.poll(until - since - len(records))
            if not got:
                raise RuntimeError(f"the update log ends before version {until}")
            records += got
    finally:
        follower.close()
    appended = sum(int(r.features.shape[0]) for r in records if isinstance(r, NodeRecord))
    next_id = num_nodes_now - appended
    struct, feature, added = [], [], []
    for r in records:
        if isinstance(r, EdgeRecord):
            struct += [r.add[:, 1], r.remove[:, 1]]
            added.append(r.add)
        elif isinstance(r, NodeRecord):
            count = int(r.features.shape[0])
            feature.append(np.arange(next_id, next_id + count, dtype=np.int64))
            next_id += count
        elif isinstance(r, FeatureRecord):
            feature.append(r.node_ids)
    if records:
        table.mark(union_of(struct), union_of(feature), np.concatenate(added) if added else None,
                   until, float(records[0].accepted_s))
        table.settle_marks()
    return len(records)

