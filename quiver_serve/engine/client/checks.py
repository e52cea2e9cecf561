"""Checks of an embed request against the living graph, shared by the HTTP routes and Pipeline.

Nodes are appended while the daemon serves (docs/architecture.md, "The living graph"), and a
front-end process learns the node count about ten times a second, or from its own node additions: an
id past the count it knows may exist by the time the request reaches an engine core, which knows the
exact count. So the door refuses only what can never be valid (below 0, or at or past the node
capacity), naming the range it knows; ids between are the engine core's to check.

Inductive nodes (``new_nodes``) are checked here whole: width (422 naming the node), finite
values (400), neighbour ids (400, the same rule), and the request's rows (413).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from quiver_serve import errors
from quiver_serve.graph.typed import HOMOGENEOUS_NODE_TYPE
from quiver_serve.wire import RELATION_SHIFT, InductiveNodes


def check_ids_at_door(ids: np.ndarray, num_nodes: int, node_capacity: int,
                      field: str = "") -> None:
    """400 naming an id below 0 or at or past ``node_capacity`` (``ids`` int64); the message
    gives the range the caller knows (``num_nodes``)."""
    if ids.size == 0:
        return
    if ids.size == 1:
        lo = hi = int(ids[0])
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= max(node_capacity, num_nodes):
        message = errors.out_of_range_message(lo if lo < 0 else hi, num_nodes)
        raise errors.invalid(f"{field}: {message}" if field else message)


def check_rows(num_ids: int, num_new: int, limit: int) -> None:
    """413 when the answer would have more rows than ``server.max_request_nodes``."""
    if num_ids + num_new > limit:
        raise errors.ServeError(
            "too_many_nodes", f"{num_ids + num_new} rows in one request ({num_ids} node ids + "
            f"{num_new} new nodes); the limit is {limit}", 413)


def _bad(message: str, status: int = 400) -> errors.ServeError:
    return errors.ServeError("invalid_new_nodes", message, status)


def _feature_rows(rows: Sequence[Sequence[float]], width: int) -> np.ndarray:
    for i, row in enumerate(rows):
        if len(row) != width:
            raise _bad(f"new_nodes[{i}].features has {len(row)} values; this graph's features "
                       f"have {width}", 422)
    try:
        feats = np.array(rows, dtype=np.float32).reshape(len(rows), width)
    except (TypeError, ValueError, OverflowError):
        raise _bad("new_nodes[].features must be lists of numbers", 422) from None
    finite = np.isfinite(feats).all(axis=1)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise _bad(f"new_nodes[{i}].features has a NaN or infinite value")
    return feats


def _neighbors(lists: Sequence[Sequence[int]], num_nodes: int,
               node_capacity: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.fromiter((len(x) for x in lists), np.int64, len(lists))
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = list(itertools.chain.from_iterable(lists))
    try:
        neighbors = np.array(flat, dtype=np.int64).reshape(-1)
    except OverflowError:
        bad = min(flat) if min(flat) < 0 else max(flat)
        raise _bad(f"new_nodes[].in_neighbors: node id {bad} is out of range (beyond int64)") \
            from None
    except (TypeError, ValueError):
        raise _bad("new_nodes[].in_neighbors must be lists of integers", 422) from None
    if neighbors.size:
        bad_at = np.flatnonzero((neighbors < 0) | (neighbors >= max(node_capacity, num_nodes)))
        if bad_at.size:
            node = int(np.searchsorted(offsets, bad_at[0], side="right") - 1)
            raise _bad(f"new_nodes[{node}].in_neighbors: " + errors.out_of_range_message(
                int(neighbors[bad_at[0]]), num_nodes))
    return offsets, neighbors


def inductive_nodes(features: Sequence[Sequence[float]], in_neighbors: Sequence[Sequence[int]],
                    num_features: int, num_nodes: int,
                    node_capacity: int) -> InductiveNodes | None:
    """The new nodes of one request as the engine takes them, or the 4xx naming what is wrong
    (None when there are none). ``features[i]`` and ``in_neighbors[i]`` are node i's."""
    if len(features) == 0:
        return None
    if len(in_neighbors) != len(features):
        raise _bad(f"{len(features)} feature rows but {len(in_neighbors)} neighbour lists", 422)
    for i, given in enumerate(in_neighbors):
        if isinstance(given, dict):
            raise _bad(f"new_nodes[{i}].in_neighbors maps relations, which only a typed graph "
                       "has; give a list of node ids", 422)
    feats = _feature_rows(features, num_features)
    offsets, neighbors = _neighbors(in_neighbors, num_nodes, node_capacity)
    return InductiveNodes(feats, offsets, neighbors)



def inductive_from_dicts(new_nodes: Sequence[dict], num_features: int, num_nodes: int,  # type: ignore[type-arg]
                         node_capacity: int) -> InductiveNodes | None:
    """``[{"features": [...], "in_neighbors": [...]}, ...]`` (the HTTP body's form, which the
    queue API takes too) as :func:`inductive_nodes` checks it."""
    return inductive_nodes(*split_new_nodes(new_nodes), num_features, num_nodes, node_capacity)


def split_new_nodes(new_nodes: Sequence[dict]) -> tuple[list[Any], list[Any]]:  # type: ignore[type-arg]
    """The feature rows and in-neighbours of ``[{"features", "in_neighbors"}, ...]``."""
    try:
        features = [node["features"] for node in new_nodes]
        neighbors = [node.get("in_neighbors", []) for node in new_nodes]
    except (TypeError, KeyError, AttributeError):
        raise _bad('new_nodes must be a list of {"features": [...], "in_neighbors": [...]}',
                   422) from None
    return features, neighbors


#: the largest graph version a request may ask for (the wire carries it as a signed 64-bit int)
MAX_VERSION = 2**63 - 1


def check_min_version(min_version: int) -> None:
    if not isinstance(min_version, int) or isinstance(min_version, bool) \
            or not 0 <= min_version <= MAX_VERSION:
        raise errors.ServeError("invalid_min_version", f"min_version must be an integer in "
                                f"[0, {MAX_VERSION}], got {min_version!r}", 400)


#: characters of an unknown node type an error quotes (a client's string, bounded)
NAME_SHOWN = 128


def names_a_type(node_type: str, node_types: dict[str, int] | None) -> bool:
    """Whether a request's ``node_type`` needs the typed checks (``check_typed_request``): on a
    typed graph always; on an untyped one unless it names none or the one type."""
    return node_types is not None or node_type not in ("", HOMOGENEOUS_NODE_TYPE)


def typed_inductive_nodes(features: Sequence[Sequence[float]], in_neighbors: Sequence[Any],
                          ) -> InductiveNodes | None:
    """A typed graph's new nodes as the engine core takes them (None when there are none):
    ``in_neighbors[i]`` maps relations (``"src__rel__dst"``, or ``rel`` when one relation of that
    name enters the type) to source ids, or is a list when the type has one relation into it.
    Checked here: numbers, one width for every row, ids in [0, 2^48); the type's width, the
    relations and each source type's range in the engine core, which knows the graph."""
    if len(features) == 0:
        return None
    if len(in_neighbors) != len(features):
        raise _bad(f"{len(features)} feature rows but {len(in_neighbors)} neighbour lists", 422)
    widths = {len(row) if isinstance(row, Sequence) else -1 for row in features}
    if len(widths) != 1:
        raise _bad("new_nodes[].features must be lists of numbers of one length (the node type's "
                   "feature width; [] for a type without features)", 422)
    feats = _feature_rows(features, widths.pop())
    names: list[str] = []
    lists, rels = [], []
    for i, given in enumerate(in_neighbors):
        groups = given.items() if isinstance(given, dict) else [("", given)]
        ids_i: list[Any] = []
        rel_i: list[int] = []
        for name, ids in groups:
            if not isinstance(name, str) or len(name) > 256 or not isinstance(ids, list):
                raise _bad(f"new_nodes[{i}].in_neighbors must map relation names to lists of "
                           "node ids", 422)
            if name not in names:
                names.append(name)
            ids_i += ids
            rel_i += [names.index(name)] * len(ids)
        lists.append(ids_i)
        rels.append(rel_i)
    offsets, neighbors = _neighbors(lists, 1 << RELATION_SHIFT, 1 << RELATION_SHIFT)
    words = np.fromiter(itertools.chain.from_iterable(rels), np.int64, neighbors.size)
    return InductiveNodes(feats, offsets, (words << RELATION_SHIFT) | neighbors, tuple(names))


def check_typed_request(ids: np.ndarray, node_type: str, node_types: dict[str, int] | None,
                        max_request_nodes: int, new_nodes: int = 0) -> None:
    """The checks of a request naming a node type (docs/architecture.md, "Typed graphs"): 400
    for a type the graph lacks (naming the known types), a missing type when there are several,
    a type on a graph of one type it is not, and ids out of the type's range (none may be
    given with ``new_nodes``)."""
    if node_types is None:
        raise errors.ServeError("invalid_node_type", f"unknown node_type {node_type[:NAME_SHOWN]!r}: this "
                                f"daemon serves an untyped graph (its one type is "
                                f"{HOMOGENEOUS_NODE_TYPE!r}); leave node_type out", 400)
    if not node_type:
        if len(node_types) != 1:
            raise errors.ServeError("invalid_node_type", "node_type is required: the graph's "
                                    f"node types are {sorted(node_types)}", 400)
        node_type = next(iter(node_types))
    if node_type not in node_types:
        raise errors.ServeError("invalid_node_type", f"unknown node_type {node_type[:NAME_SHOWN]!r}: the "
                                f"graph's node types are {sorted(node_types)}", 400)
    if ids.size or not new_nodes:
        errors.check_node_ids(ids, node_types[node_type], max_request_nodes)
    check_rows(int(ids.size), new_nodes, max_request_nodes)
