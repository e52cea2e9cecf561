"""What each partition server holds, built from a whole graph and written as one snapshot folder
per partition (docs/architecture.md, "Partitioning"; docs/decisions/0042-partitioning.md).

Partition ``p`` holds the in-edge lists of the nodes it owns (rows in local order, sources as
GLOBAL ids, sorted within each list as in the whole graph's CSC), their feature rows and labels,
and the rows of other partitions its requests are likeliest to read (``hot.py``). Sampling keeps
the single-machine semantics because random numbers are keyed by global id
(``sampling/base.py``): the owner of a node draws the same neighbours the whole graph would.

On disk (``save_partitions``)::

    OUT/book.npz      the partition book (book.py)
    OUT/stats.json    edge cut, balance, replicated rows, seconds per phase
    OUT/part-<p>/     write_base_dir's format (graph/base_files.py): one .npy per array, each
                      with its blake2b content hash in meta.json, memory-mappable
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from quiver_serve.graph.base_files import (
    array_digest,
    byte_progress,
    write_base_dir,
    write_synced,
)
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.log_reader import META_NAME
from quiver_serve.partition.book import PartitionBook
from quiver_serve.partition.hot import hot_rows
from quiver_serve.partition.methods import assign, check_method
from quiver_serve.partition.stats import PartitionStats, partition_stats

log = logging.getLogger(__name__)

BOOK_NAME = "book.npz"
STATS_NAME = "stats.json"
#: arrays of a partition folder, and the ones it may lack
PART_ARRAYS = ("global_ids", "indptr", "indices", "x", "hot_ids", "hot_x", "y")
OPTIONAL_ARRAYS = ("y",)
#: what ``meta.json``'s ``meta.kind`` says of a partition folder
PART_KIND = "quiver-serve partition"
#: graphs smaller than this many bytes (CSC and features) partition without progress bars, as
#: ``base_files.byte_progress`` stays silent below it
QUIET_BYTES = 256 << 20


class PartitionFolderError(ValueError):
    """A partition folder that cannot be used (its message names the file)."""


@dataclass
class PartitionData:
    """What one partition server holds."""

    part: int
    book: PartitionBook
    global_ids: np.ndarray  # int64 [owned]: owned nodes' global ids, in local-row order
    indptr: np.ndarray  # int64 [owned + 1]: in-edge lists of owned nodes, by local row
    indices: np.ndarray  # int64 [edges]: SOURCE GLOBAL ids, sorted within each list
    features: np.ndarray  # float32 [owned, F]
    hot_ids: np.ndarray  # int64 [H]: other partitions' rows replicated here, sorted by id
    hot_features: np.ndarray  # float32 [H, F]
    labels: np.ndarray | None

    @property
    def num_owned(self) -> int:
        return int(self.global_ids.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])


def part_dir(out_dir: Path, part: int) -> Path:
    return Path(out_dir) / f"part-{part}"


def check_request(graph: GraphData, num_parts: int, method: str, hot_budget_bytes: int) -> None:
    """ValueError naming the argument that cannot be partitioned."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise ValueError(f"parts must be an integer >= 1, got {num_parts!r}")
    if num_parts > graph.num_nodes:
        raise ValueError(f"parts ({num_parts}) must not exceed the graph's {graph.num_nodes} nodes "
                         "(every partition owns at least one)")
    check_method(method)
    if hot_budget_bytes < 0:
        raise ValueError(f"hot budget must be >= 0 bytes, got {hot_budget_bytes}")


def local_rows(owner: np.ndarray, num_parts: int) -> np.ndarray:
    """Each node's row within its owner: its rank among the owner's nodes by global id."""
    order = np.argsort(owner, kind="stable")
    sizes = np.bincount(owner, minlength=num_parts)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    local = np.empty(owner.shape[0], dtype=np.int64)
    local[order] = np.arange(owner.shape[0], dtype=np.int64) - np.repeat(starts, sizes)
    return local


def gather_lists(indptr: np.ndarray, indices: np.ndarray,
                 ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, indices)`` of the in-edge lists of ``ids``, in that order (vectorised)."""
    starts = indptr[ids]
    counts = indptr[ids + 1] - starts
    sub_indptr = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=sub_indptr[1:])
    total = int(sub_indptr[-1])
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts - sub_indptr[:-1], counts)
    return sub_indptr, indices[positions]


def partition_graph(graph: GraphData, num_parts: int, method: str = "metis",
                    hot_budget_bytes: int = 0, fap_fanouts: list[int] | None = None,
                    seed: int = 0, fap_batch_size: int = 1024
                    ) -> tuple[PartitionBook, list[PartitionData], PartitionStats]:
    """The book, each partition's data and the stats of partitioning ``graph`` by ``method``.
    Hot rows fill at most ``hot_budget_bytes`` of float32 rows per partition, chosen by FAP
    under ``fap_fanouts`` (required when the budget is not 0) and ``fap_batch_size``."""
    check_request(graph, num_parts, method, hot_budget_bytes)
    if hot_budget_bytes and not fap_fanouts:
        raise ValueError("a hot-row budget needs the fanouts requests are sampled with")
    phase_s: dict[str, float] = {}
    indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
    x, y = graph.x.numpy(), None if graph.y is None else graph.y.numpy()
    t0 = time.perf_counter()
    owner = assign(indptr, indices, int(num_parts), method, seed)
    book = PartitionBook(owner=owner, local=local_rows(owner, num_parts), num_parts=num_parts,
                         method=method)
    phase_s["assign"] = time.perf_counter() - t0
    row_bytes = max(1, graph.num_features * 4)
    max_rows = hot_budget_bytes // row_bytes
    hot: list[tuple[np.ndarray, float]] = []
    t0 = time.perf_counter()
    quiet = indptr.nbytes + indices.nbytes + x.nbytes < QUIET_BYTES
    for p in tqdm(range(num_parts), "FAP hot rows", unit="part", disable=quiet or max_rows == 0):
        hot.append(hot_rows(graph.indptr, graph.indices, owner, p, list(fap_fanouts or []),
                            fap_batch_size, max_rows))
    phase_s["hot_rows"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    parts = []
    for p in tqdm(range(num_parts), "partition data", unit="part", disable=quiet):
        ids = book.global_ids(p)
        sub_indptr, sub_indices = gather_lists(indptr, indices, ids)
        parts.append(PartitionData(
            part=p, book=book, global_ids=ids, indptr=sub_indptr, indices=sub_indices,
            features=x[ids], hot_ids=hot[p][0], hot_features=x[hot[p][0]],
            labels=None if y is None else y[ids]))
    phase_s["gather"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = partition_stats(graph, book, [h for _, h in hot], [len(i) for i, _ in hot], phase_s)
    phase_s["stats"] = time.perf_counter() - t0
    return book, parts, stats


def part_arrays(data: PartitionData) -> dict[str, np.ndarray]:
    arrays = {"global_ids": data.global_ids, "indptr": data.indptr, "indices": data.indices,
              "x": data.features, "hot_ids": data.hot_ids, "hot_x": data.hot_features}
    if data.labels is not None:
        arrays["y"] = data.labels
    return arrays


def save_partitions(out_dir: Path, book: PartitionBook, parts: list[PartitionData],
                    stats: PartitionStats, graph_name: str = "") -> None:
    """``out_dir`` (new or empty) holding every partition's folder, the book and the stats;
    the book is written last, so a folder with ``book.npz`` is complete."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder (partitions are "
                              "written to a new one)")
    if len(parts) != book.num_parts:
        raise ValueError(f"{len(parts)} partitions for a book of {book.num_parts}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for data in parts:  # write_base_dir shows a bar per partition of 256 MiB or more
        meta = {"kind": PART_KIND, "part": data.part, "num_parts": book.num_parts,
                "num_nodes": book.num_nodes, "method": book.method, "graph": graph_name}
        write_base_dir(part_dir(out_dir, data.part), 0, part_arrays(data), meta,
                       lambda _point: None)
    write_synced(out_dir / STATS_NAME, json.dumps(stats.to_json(), indent=2).encode())
    book.save(out_dir / BOOK_NAME)


def load_book(out_dir: Path) -> PartitionBook:
    path = Path(out_dir) / BOOK_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {out_dir} is not a finished partitioning "
                                "(python -m quiver_serve.partition writes it last)")
    return PartitionBook.load(path)


def load_partition(out_dir: Path, part: int, mmap: bool = True, verify: bool = False,
                   book: PartitionBook | None = None) -> PartitionData:
    """Partition ``part`` of ``out_dir``: arrays memory-mapped read-only (``mmap``), checked
    against meta.json's dtypes and shapes and, with ``verify``, its content hashes."""
    book = load_book(out_dir) if book is None else book
    if not 0 <= part < book.num_parts:
        raise ValueError(f"partition {part} is not in [0, {book.num_parts}) of {out_dir}")
    folder = part_dir(out_dir, part)
    info = _read_meta(folder)
    meta = info.get("meta", {})
    if meta.get("kind") != PART_KIND or meta.get("part") != part \
            or meta.get("num_parts") != book.num_parts:
        raise PartitionFolderError(f"{folder / META_NAME} is not partition {part} of "
                                   f"{book.num_parts} (meta: {meta})")
    arrays = {name: _map_array(folder, name, spec, mmap, verify)
              for name, spec in info["arrays"].items()}
    missing = [a for a in PART_ARRAYS if a not in arrays and a not in OPTIONAL_ARRAYS]
    if missing:
        raise PartitionFolderError(f"{folder}: arrays {missing} missing")
    return PartitionData(part=part, book=book, global_ids=arrays["global_ids"],
                         indptr=arrays["indptr"], indices=arrays["indices"],
                         features=arrays["x"], hot_ids=arrays["hot_ids"],
                         hot_features=arrays["hot_x"], labels=arrays.get("y"))


def _read_meta(folder: Path) -> dict:
    try:
        info = json.loads((folder / META_NAME).read_text())
    except FileNotFoundError:
        raise PartitionFolderError(f"{folder / META_NAME} does not exist (not a partition "
                                   "folder, or one whose writing did not finish)") from None
    except ValueError as exc:
        raise PartitionFolderError(f"{folder / META_NAME} is not JSON: {exc}") from exc
    if not isinstance(info, dict) or not isinstance(info.get("arrays"), dict):
        raise PartitionFolderError(f"{folder / META_NAME} lists no arrays")
    return info


def _map_array(folder: Path, name: str, spec: dict, mmap: bool, verify: bool) -> np.ndarray:
    path = folder / f"{name}.npy"
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PartitionFolderError(f"{path} cannot be read: {exc}") from exc
    if arr.dtype.str != spec.get("dtype") or list(arr.shape) != spec.get("shape"):
        raise PartitionFolderError(f"{path} is {arr.dtype}{list(arr.shape)}, meta.json says "
                                   f"{spec.get('dtype')}{spec.get('shape')}")
    if verify:
        with byte_progress(arr.nbytes, f"checking {name}") as bar:
            digest = array_digest(arr, bar)
        if digest != spec.get("blake2b"):
            raise PartitionFolderError(f"{path}: content hash {digest} is not meta.json's "
                                       f"{spec.get('blake2b')} (a damaged file)")
    return arr


def graph_of(parts: list[PartitionData]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole graph's ``(indptr, indices)`` put back together from every partition (what
    tests compare with the graph partitioned)."""
    book = parts[0].book
    degree = np.zeros(book.num_nodes, dtype=np.int64)
    for data in parts:
        degree[data.global_ids] = np.diff(data.indptr)
    indptr = np.zeros(book.num_nodes + 1, dtype=np.int64)
    np.cumsum(degree, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    for data in parts:
        starts = indptr[data.global_ids]
        counts = np.diff(data.indptr)
        positions = np.arange(data.num_edges, dtype=np.int64) + np.repeat(
            starts - data.indptr[:-1], counts)
        indices[positions] = data.indices
    return torch.from_numpy(indptr), torch.from_numpy(indices)
