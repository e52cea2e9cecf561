"""The files of a base (docs/architecture.md, "The living graph"; decision 0039): one .npy per
array (no pickle), each named in ``meta.json`` with its dtype, shape and blake2b content hash,
``meta.json`` written last. An array whose content hash, dtype and shape match one of the base
in force is a hard link to that file, so a compaction writes only the arrays that changed and
dropping the old base frees only what no newer base names. ``update_log.py`` puts a base in
force (``CURRENT``) and drops the old ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from quiver_serve.graph.log_reader import META_NAME, read_current

#: bump when the base's layout changes
BASE_FORMAT = 1
ARRAY_NAME_RE = re.compile(r"[A-Za-z0-9_]+")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())




#: bytes written (and hashed) at a time
WRITE_CHUNK_BYTES = 64 << 20
#: a large file is synced every this many bytes as it is written (``write_array``)
SYNC_EVERY_BYTES = 8 << 20


def write_array(f: Any, arr: np.ndarray, bar: Any) -> str:
    """``arr`` as an .npy file (no pickle) in chunks; returns the blake2b digest of its data
    (the array's content key: what derived tables and other snapshots name it by).

    The file is synced every ``SYNC_EVERY_BYTES`` as it is written, so that its dirty pages
    never pile up: on ext4 (and other journalling file systems) a concurrent fsync of the update
    log waits for the writeback the journal commit carries, and a gigabyte of a compaction's base
    written unsynced held acknowledged updates for 200 ms (decision 0057)."""
    if arr.dtype.hasobject:
        raise ValueError("object arrays cannot be saved when allow_pickle=False (a base holds "
                         "numbers only)")
    arr = np.ascontiguousarray(arr)
    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
    digest = hashlib.blake2b(digest_size=16)
    flat = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    for at in range(0, flat.size, WRITE_CHUNK_BYTES):
        chunk = flat[at:at + WRITE_CHUNK_BYTES]
        digest.update(chunk)
        for piece in range(0, chunk.size, SYNC_EVERY_BYTES):
            f.write(chunk[piece:piece + SYNC_EVERY_BYTES].data)
            if flat.size > SYNC_EVERY_BYTES:
                f.flush()
                os.fdatasync(f.fileno())
        bar.update(chunk.size)
    return digest.hexdigest()


def byte_progress(total_bytes: int, desc: str) -> Any:
    """A tqdm bar over bytes (silent below 256 MiB, and where tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return contextlib.nullcontext(_NoBar())
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc,
                disable=total_bytes < (256 << 20))


class _NoBar:
    def update(self, n: int) -> None:
        pass


def array_digest(arr: np.ndarray, bar: Any) -> str:
    """The blake2b digest of ``arr``'s bytes in C order (what ``write_array`` returns)."""
    arr = np.ascontiguousarray(arr)
    digest = hashlib.blake2b(digest_size=16)
    flat = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    for at in range(0, flat.size, WRITE_CHUNK_BYTES):
        digest.update(flat[at:at + WRITE_CHUNK_BYTES])
        bar.update(min(WRITE_CHUNK_BYTES, flat.size - at))
    return digest.hexdigest()


def pieces_in_force(directory: Path) -> dict[tuple[str, str, tuple[int, ...]], Path]:
    """Each array file of the base in force by (content hash, dtype, shape): what a new base
    links instead of writing again."""
    name = read_current(directory)
    if name is None:
        return {}
    try:
        info = json.loads((directory / name / META_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {(spec["blake2b"], spec["dtype"], tuple(spec["shape"])): directory / name / f"{a}.npy"
            for a, spec in info["arrays"].items() if "blake2b" in spec}


def _link(existing: Path, target: Path) -> bool:
    """``target`` as a second name of ``existing``; False where the file system has no hard
    links (the array is then written again)."""
    try:
        os.link(existing, target)
    except OSError:
        return False
    return True


def write_base_dir(path: Path, version: int, arrays: dict[str, np.ndarray], meta: dict,
                   crash_point: Callable[[str], None]) -> None:
    """Every file of ``path`` written and synced (each array's content hash in meta.json),
    then the folder and its parent. An array whose content hash, dtype and shape match one of
    the base in force is a hard link to that file (bases are never written after ``CURRENT``
    names them), so a compaction rewrites only what changed."""
    listing = {}
    for name, arr in arrays.items():
        if not ARRAY_NAME_RE.fullmatch(name):
            raise ValueError(f"array name {name!r} must match [A-Za-z0-9_]+ (it names a file)")
        arr = np.asarray(arr)
        listing[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape)}
    # Serialised before anything is written: meta that is not JSON fails with nothing on disk.
    json.dumps({"format": BASE_FORMAT, "version": version, "arrays": listing, "meta": meta})
    if path.exists():  # an earlier failed attempt at this version (never CURRENT: it is newer)
        shutil.rmtree(path)
    path.mkdir()
    crash_point("base.mkdir")
    shared = pieces_in_force(path.parent)
    total = sum(np.asarray(a).nbytes for a in arrays.values())
    with byte_progress(2 * total if shared else total,
                       f"writing the graph at version {version}") as bar:
        for name, arr in arrays.items():
            spec = listing[name]
            target = path / f"{name}.npy"
            if shared:
                spec["blake2b"] = array_digest(np.asarray(arr), bar)
                same = shared.get((spec["blake2b"], spec["dtype"], tuple(spec["shape"])))
                if same is not None and _link(same, target):
                    bar.update(np.asarray(arr).nbytes)
                    spec["linked"] = True
                    crash_point("base.array")
                    continue
            with open(target, "wb") as f:
                spec["blake2b"] = write_array(f, np.asarray(arr), bar)
                f.flush()
                os.fsync(f.fileno())
            crash_point("base.array")
    meta_bytes = json.dumps({"format": BASE_FORMAT, "version": version, "arrays": listing,
                             "meta": meta}).encode()
    write_synced(path / META_NAME, meta_bytes)
    crash_point("base.meta")
    fsync_dir(path)
    fsync_dir(path.parent)
    crash_point("base.synced")
