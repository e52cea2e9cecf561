"""Which partition owns each node (docs/decisions/0042-partitioning.md): METIS k-way, or a named
fallback for graphs METIS cannot hold in memory.

* ``metis``: k-way METIS (pymetis) on the undirected, symmetrised adjacency (self loops and
  duplicate pairs dropped), built with scipy, no Python loop per node. Each vertex weighs
  ``c + in_degree`` with ``c`` the graph's mean in-degree (rounded, at least 1): balancing that
  sum within METIS's tolerance (``ufactor`` 30: 1.03) balances nodes and in-edges together, the
  two terms weighing the same in total. pymetis 2025.2.2 reads one weight per vertex (a
  ``2 * N`` multi-constraint vector gives the same partition as its first ``N`` entries), so the
  two constraints are folded into one.
* ``range``: contiguous id ranges cut where the running sum of the same weights crosses each
  ``1/P``: balanced like METIS, no locality beyond what the ids carry, O(N).
* ``hash``: ``splitmix64(id ^ seed) mod P``: balanced in expectation, O(N), no state.
* ``ldg``: linear deterministic greedy (Stanton and Kliot, KDD 2012), streamed over the CSC in
  id order: a node goes to the partition holding most of its already-placed in-neighbours,
  scaled by the room left there (``1 - load / capacity`` of the fuller of its nodes and its
  in-edges, capacity 1.05 of an equal share of each); ties and nodes with no placed neighbour
  go to the partition with the most room.
  Vectorised over chunks of nodes placed together (each chunk at most 1/32 of a partition's
  share, so a chunk cannot overfill one), O(E) with no copy of the edges.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from tqdm import tqdm

log = logging.getLogger(__name__)

METHODS = ("metis", "ldg", "range", "hash")
#: what ``method="auto"`` resolves to: METIS up to a size, the fallback above it
AUTO = "auto"
#: METIS's default k-way imbalance tolerance (``ufactor`` 30, in thousandths)
METIS_TOLERANCE = 1.03
#: ldg: a partition's capacity over an equal share of the weight
LDG_SLACK = 1.05
#: ldg: nodes placed together, at most (and at most 1/32 of a partition's share)
LDG_CHUNK_NODES = 4096


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown partitioning method {method!r}: choose one of "
                         f"{', '.join(METHODS)} (or {AUTO})")


def resolve_method(method: str, num_edges: int, metis_max_edges: int, fallback: str) -> str:
    """``method``, or for ``auto`` METIS up to ``metis_max_edges`` in-edges and ``fallback``
    above (logged)."""
    if method != AUTO:
        check_method(method)
        return method
    check_method(fallback)
    if num_edges <= metis_max_edges:
        return "metis"
    log.warning("partitioning with %s, not METIS: %d edges is above partition.metis_max_edges "
                "(%d; METIS takes about 260 bytes per edge, decision 0042); name --method metis "
                "or raise the limit on a host with the memory", fallback, num_edges,
                metis_max_edges)
    return fallback


def balance_weights(indptr: np.ndarray) -> np.ndarray:
    """Per node ``c + in_degree`` (int64), ``c`` the mean in-degree rounded (at least 1)."""
    degree = np.diff(indptr).astype(np.int64)
    num_nodes = degree.shape[0]
    c = max(1, round(int(indptr[-1]) / max(num_nodes, 1)))
    return degree + c


def assign(indptr: np.ndarray, indices: np.ndarray, num_parts: int, method: str,
           seed: int = 0) -> np.ndarray:
    """The owner (int32 [num_nodes]) of every node by ``method``."""
    check_method(method)
    num_nodes = indptr.shape[0] - 1
    if num_parts == 1:
        return np.zeros(num_nodes, dtype=np.int32)
    if method == "hash":
        owner = hash_parts(num_nodes, num_parts, seed)
    elif method == "range":
        owner = range_parts(balance_weights(indptr), num_parts)
    elif method == "ldg":
        owner = ldg_parts(indptr, indices, num_parts)
    else:
        owner = metis_parts(indptr, indices, num_parts, seed)
    return fill_empty(owner, num_parts)


def fill_empty(owner: np.ndarray, num_parts: int) -> np.ndarray:
    """``owner`` with every partition owning at least one node: each empty one takes the last
    node of the largest (logged; a method leaves partitions empty only when they are few nodes
    each, e.g. METIS asked for ~1,000 parts of Cora). Needs ``num_parts <= len(owner)``."""
    sizes = np.bincount(owner, minlength=num_parts)
    empty = np.flatnonzero(sizes == 0)
    if empty.size == 0:
        return owner
    owner = owner.copy()
    for part in empty:
        donor = int(np.argmax(sizes))
        node = int(np.flatnonzero(owner == donor)[-1])
        owner[node] = part
        sizes[donor] -= 1
        sizes[part] += 1
    log.warning("%d of %d partitions came out empty; each took one node of the largest",
                empty.size, num_parts)
    return owner


def hash_parts(num_nodes: int, num_parts: int, seed: int = 0) -> np.ndarray:
    """``splitmix64(id ^ seed) mod num_parts`` for every id."""
    with np.errstate(over="ignore"):
        z = np.arange(num_nodes, dtype=np.uint64) ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_parts)).astype(np.int32)


def range_parts(weights: np.ndarray, num_parts: int) -> np.ndarray:
    """Contiguous ranges of ids, cut where the running weight crosses each ``1/num_parts``."""
    running = np.cumsum(weights, dtype=np.int64)
    total = int(running[-1]) if running.size else 0
    if total == 0:
        return (np.arange(weights.shape[0]) * num_parts // max(weights.shape[0], 1)).astype(np.int32)
    # the weight before each node's midpoint decides its range: a heavy node sits where most of it is
    mid = running - (weights + 1) // 2
    return np.minimum(mid * num_parts // total, num_parts - 1).astype(np.int32)


def ldg_parts(indptr: np.ndarray, indices: np.ndarray, num_parts: int,
              slack: float = LDG_SLACK) -> np.ndarray:
    """Linear deterministic greedy over the in-edge lists, in chunks of nodes (module notes);
    the room left in a partition is the smaller of its node room and its in-edge room."""
    num_nodes = indptr.shape[0] - 1
    degree = np.diff(indptr)
    node_cap = slack * num_nodes / num_parts
    edge_cap = slack * max(int(indptr[-1]), 1) / num_parts
    chunk = int(max(1, min(LDG_CHUNK_NODES, num_nodes // (num_parts * 32))))
    owner = np.full(num_nodes, -1, dtype=np.int32)
    nodes = np.zeros(num_parts, dtype=np.float64)
    edges = np.zeros(num_parts, dtype=np.float64)
    for lo in tqdm(range(0, num_nodes, chunk), "ldg", unit="chunk",
                   disable=indices.nbytes < (256 << 20)):
        hi = min(num_nodes, lo + chunk)
        src_owner = owner[indices[indptr[lo]:indptr[hi]]]
        row = np.repeat(np.arange(hi - lo), degree[lo:hi])
        placed = src_owner >= 0
        counts = np.bincount(row[placed] * num_parts + src_owner[placed],
                             minlength=(hi - lo) * num_parts).reshape(hi - lo, num_parts)
        room = 1.0 - np.maximum(nodes / node_cap, edges / edge_cap)
        # the small room term breaks ties and places nodes with no placed neighbour (or with
        # every neighbour's partition full) where there is most room, even when all are full
        choice = np.argmax(counts * np.clip(room, 0.0, None) + 1e-6 * room,
                           axis=1).astype(np.int32)
        owner[lo:hi] = choice
        nodes += np.bincount(choice, minlength=num_parts)
        edges += np.bincount(choice, weights=degree[lo:hi], minlength=num_parts)
    return owner


def symmetric_adjacency(indptr: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(xadj, adjncy)`` of the undirected graph METIS takes: u~v when u->v or v->u, no self
    loops, each pair once per direction, lists sorted."""
    import scipy.sparse as sp

    num_nodes = indptr.shape[0] - 1
    ones = np.ones(indices.shape[0], dtype=np.bool_)
    # row v holds v's in-neighbours (the CSC read as CSR of the transpose)
    a = sp.csr_matrix((ones, indices, indptr), shape=(num_nodes, num_nodes))
    sym = (a + a.T).tocsr()
    del a
    sym.setdiag(False)
    sym.eliminate_zeros()
    sym.sort_indices()
    return sym.indptr, sym.indices


def metis_parts(indptr: np.ndarray, indices: np.ndarray, num_parts: int,
                seed: int = 0) -> np.ndarray:
    """METIS k-way on the symmetrised adjacency, vertices weighted by ``balance_weights``."""
    try:
        import pymetis
    except ImportError as exc:
        raise RuntimeError("method metis needs pymetis (pip install 'quiver-serve[partition]'); "
                           "or choose --method hash or range") from exc
    t0 = time.perf_counter()
    xadj, adjncy = symmetric_adjacency(indptr, indices)
    log.info("symmetrised adjacency for METIS: %d entries in %.1f s", adjncy.shape[0],
             time.perf_counter() - t0)
    options = pymetis.Options(seed=int(seed) & 0x7FFFFFFF)
    t0 = time.perf_counter()
    _cut, membership = pymetis.part_graph(
        num_parts, pymetis.CSRAdjacency(xadj, adjncy), vweights=balance_weights(indptr),
        options=options, recursive=False)
    log.info("METIS k-way into %d parts in %.1f s", num_parts, time.perf_counter() - t0)
    return np.asarray(membership, dtype=np.int32)
