"""Request streams: the workloads of docs/architecture.md, "Performance contract", and trace replay.

(a) 48 ids drawn from a fixed hot set of 1,500 nodes, half the lowest and half the highest
in-degree; (b) 48 ids uniform over every node; (c) 1 id uniform. Routing mixes (issue 10): light,
heavy, mixed: 48 ids from the hot set's low-degree half, its high-degree half, or alternating. A trace is an ``.npy`` file,
one row per request, sent in row order (see :func:`load_trace` for the format).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IDS_PER_REQUEST = {"a": 48, "b": 48, "c": 1, "light": 48, "heavy": 48, "mixed": 48}
HOT_SET_SIZE = 1500
REQUEST_POOL = 4096  # distinct requests each load process cycles through (workloads a, b, c)


def hot_set(degree: np.ndarray, size: int = HOT_SET_SIZE, seed: int = 0) -> np.ndarray:
    """Workload (a)'s fixed hot set: half the lowest in-degree nodes, half the highest (ties broken
    by a seeded permutation, so it is not just the lowest ids)."""
    n = degree.size
    half = min(size // 2, n // 2)
    perm = np.random.default_rng(seed).permutation(n)
    order = perm[np.argsort(degree[perm], kind="stable")]
    return np.concatenate([order[:half], order[n - half:]]).astype(np.int64)


def draw_requests(workload: str, n: int, k: int, num_nodes: int, hot: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray:
    """[n, k] int64 node ids: from the hot set (a), uniform over every node (b, c), or the
    routing mixes (issue 10): light = the hot set's low-degree half, heavy = its high-degree half,
    mixed = light and heavy rows alternating (a caller sends consecutive rows)."""
    if workload == "a":
        return hot[rng.integers(0, hot.size, (n, k))]
    if workload in ("light", "heavy", "mixed"):
        half = hot.size // 2
        light, heavy = hot[:half], hot[half:]
        if workload != "mixed":
            src = light if workload == "light" else heavy
            return src[rng.integers(0, src.size, (n, k))]
        rows = light[rng.integers(0, light.size, (n, k))]
        rows[1::2] = heavy[rng.integers(0, heavy.size, (n // 2, k))]
        return rows
    return rng.integers(0, num_nodes, (n, k), dtype=np.int64)


def load_trace(path: str | Path, allow_pickle: bool = False) -> list[np.ndarray]:
    """The requests of a trace file, in order: one int64 array of node ids per request.

    Format (``.npy``, one row per request):

    - a 2-D integer array ``[R, K]``: row i holds request i's ids; shorter requests are padded at
      the end with ``-1`` (every ``-1`` is dropped; any other negative id is an error; a row of only
      ``-1`` is an error);
    - or a 1-D object array of 1-D integer arrays (or lists), one per request. Object arrays need
      pickle to load, so they are read only with ``allow_pickle=True`` (``--trace-allow-pickle``):
      only for files you made yourself.
    """
    path = Path(path)
    try:
        arr = np.load(path, allow_pickle=allow_pickle)
    except ValueError as exc:
        raise ValueError(f"{path}: an object-array trace needs --trace-allow-pickle "
                         f"(only for files you trust): {exc}") from exc
    except OSError as exc:
        raise ValueError(f"{path}: not a readable .npy file: {exc}") from exc
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{path}: expected one .npy array, found {type(arr).__name__}")
    if arr.dtype == object:
        if arr.ndim != 1:
            raise ValueError(f"{path}: an object-array trace must be 1-D, got shape {arr.shape}")
        rows = [np.asarray(r) for r in arr]
    elif arr.ndim == 2 and np.issubdtype(arr.dtype, np.integer):
        rows = [r[r != -1] for r in arr]
    else:
        raise ValueError(f"{path}: a trace is a 2-D integer array (rows padded with -1) or a 1-D "
                         f"object array of id arrays; got shape {arr.shape} dtype {arr.dtype}")
    out = []
    for i, r in enumerate(rows):
        if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"{path}: request {i} must be a 1-D integer array, got "
                             f"shape {r.shape} dtype {r.dtype}")
        if r.size == 0:
            raise ValueError(f"{path}: request {i} has no node ids")
        if (r < 0).any():
            raise ValueError(f"{path}: request {i} has a negative id {int(r[r < 0][0])} "
                             "(only -1, as trailing padding, is allowed)")
        out.append(r.astype(np.int64))
    if not out:
        raise ValueError(f"{path}: the trace has no requests")
    return out


def process_requests(spec: dict, index: int, procs: int) -> list[np.ndarray]:
    """The requests load process ``index`` of ``procs`` sends, in order.

    A trace is dealt round-robin (process p sends rows p, p + P, ...), so with the shared arrival
    schedule (every P-th arrival is this process's) the trace leaves in row order overall.
    """
    if spec["workload"] == "trace":
        return list(spec["trace"][index::procs])
    k = spec.get("ids_per_request") or IDS_PER_REQUEST[spec["workload"]]
    n = max(16, min(REQUEST_POOL, (1 << 20) // k))
    rng = np.random.default_rng([spec.get("seed", 0), index])
    return list(draw_requests(spec["workload"], n, k, spec["num_nodes"], spec["hot"], rng))
