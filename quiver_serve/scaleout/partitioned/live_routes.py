"""What the partitioned ingress does with the living graph's calls (docs/architecture.md, "The
living graph across partitions"; decision 0047): route each update to the partitions that own
it, and read and wait on the version token an update answers.

A partitioned graph has no single version: each partition's log counts its own. An update
answers ``{"versions": {"<partition>": <version>, ...}}`` naming every partition it touched, and
``min_version`` of ``/v1/embed`` takes that token: the request waits (within its deadline) until
every partition named has applied its version.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import StrictInt

from quiver_serve import errors
from quiver_serve.engine.client.checks import inductive_from_dicts
from quiver_serve.frontend.schemas import EmbedBody
from quiver_serve.graph import living
from quiver_serve.partition.book import PartitionBook
from quiver_serve.wire import InductiveNodes


class PartitionedEmbedBody(EmbedBody):
    """The daemon's ``/v1/embed`` body, ``min_version`` also a version token."""

    min_version: StrictInt | dict[str, StrictInt] = 0  # type: ignore[assignment]


def parse_token(token: int | dict[str, int], num_parts: int) -> dict[int, int]:
    """``min_version`` as {partition: version}; 400 naming what is wrong. ``0`` (the default)
    asks for nothing; another plain integer has no meaning across partitions."""
    if isinstance(token, int):
        if token == 0:
            return {}
        raise errors.ServeError("invalid_min_version", "on a partitioned graph min_version is "
                                "the token an update answered, {\"<partition>\": <version>}, "
                                f"not a single number ({token})", 400)
    out: dict[int, int] = {}
    for key, version in token.items():
        try:
            part = int(key)
        except ValueError:
            part = -1
        if not 0 <= part < num_parts:
            raise errors.ServeError("invalid_min_version", f"min_version names partition "
                                    f"{key!r}; this graph has partitions 0..{num_parts - 1}", 400)
        if version < 0:
            raise errors.ServeError("invalid_min_version", f"min_version of partition {key} is "
                                    f"{version}; versions are >= 0", 400)
        out[part] = version
    return out


def split_edges(book: PartitionBook, add: list[list[int]], remove: list[list[int]],
                ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per partition touched: the (add, remove) pairs whose destination it owns (an edge
    ``u -> v`` lives in ``v``'s in-list); 400 naming an id outside the graph."""
    pairs = [living.as_pairs(add, "add"), living.as_pairs(remove, "remove")]
    for arr, field in zip(pairs, ("add", "remove"), strict=True):
        living.check_ids(arr.reshape(-1), book.num_nodes, field)
    owners = [book.owner[arr[:, 1]] for arr in pairs]
    touched = sorted(set(np.concatenate(owners).tolist()))
    return {int(p): (pairs[0][owners[0] == p], pairs[1][owners[1] == p]) for p in touched}


def split_rows(book: PartitionBook, node_ids: list[int], features: list[list[float]],
               ) -> dict[int, tuple[np.ndarray, list[list[float]]]]:
    """Per partition touched: the ids it owns and their rows; 4xx naming what is wrong."""
    ids = np.asarray(node_ids, dtype=np.int64)
    if ids.size != len(features):
        raise errors.ServeError("invalid_features", f"{ids.size} node_ids but {len(features)} "
                                "feature rows", 422)
    living.check_ids(ids, book.num_nodes, "node_ids")
    owner = book.owner[ids]
    return {int(p): (ids[owner == p], [features[i] for i in np.flatnonzero(owner == p)])
            for p in sorted(set(owner.tolist()))}


def merge_answers(answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One answer of an update from its partitions' answers: the version token and the summed
    counts."""
    out: dict[str, Any] = {"versions": {str(p): int(a["version"]) for p, a in answers.items()}}
    for key in ("added", "removed", "missing"):
        if any(key in a for a in answers.values()):
            out[key] = sum(int(a.get(key, 0)) for a in answers.values())
    return out


def choose_owner(book: PartitionBook) -> int:
    """The partition a call's new nodes go to: the one owning the fewest nodes now, the lowest
    number among equals (decision 0052). A function of the book alone, so a replayed sequence
    of calls places its nodes alike."""
    return int(np.argmin(book.sizes()))


def merge_growth(lists: list[list[list[int]]]) -> list[list[int]]:
    """The book's growth since the snapshot from what the partitions hold, each list
    ``[first id, count, owner]`` in id order: the longest (an entry reaches its owner first,
    then the others), every other one a beginning of it; 409 ``book_conflict`` otherwise."""
    longest = max(lists, key=len, default=[])
    for entries in lists:
        if entries != longest[:len(entries)]:
            raise errors.ServeError("book_conflict", "the partitions disagree on the new nodes "
                                    f"({entries[:3]} ... against {longest[:3]} ...)", 409)
    return longest


def adopt(book: PartitionBook, entries: list[list[int]]) -> None:
    """Enter in ``book`` the entries past its nodes (``merge_growth``'s, in id order)."""
    for first, count, owner in entries:
        if first + count <= book.num_nodes:
            continue
        if first != book.num_nodes:
            raise errors.ServeError("book_conflict", f"new nodes from {first}, the ingress's "
                                    f"book has {book.num_nodes} nodes", 409)
        book.add_nodes(count, owner)


def new_nodes_of(body: EmbedBody, ids: np.ndarray, num_features: int, book: PartitionBook,
                 max_request_nodes: int) -> InductiveNodes | None:
    """A request's own new nodes (inductive), checked as the daemon checks them (their
    in-neighbours against ``book``), or None; 413 when they and ``ids`` pass the request limit."""
    if not body.new_nodes:
        return None
    new = inductive_from_dicts([n.model_dump() for n in body.new_nodes], num_features,
                               book.num_nodes, book.num_nodes)
    assert new is not None
    if ids.size + new.count > max_request_nodes:
        raise errors.too_large(int(ids.size) + new.count, max_request_nodes)
    return new


def largest_in_neighbor(body: EmbedBody) -> int:
    """The largest id a request's new nodes name as an in-neighbour (-1: none; typed maps are
    refused later, by ``new_nodes_of``)."""
    named = [v for node in body.new_nodes or () if isinstance(node.in_neighbors, list)
             for v in node.in_neighbors]
    return max(named, default=-1)


def inductive_server(book: PartitionBook, new: InductiveNodes, ids: np.ndarray) -> int:
    """The partition whose server embeds an inductive request (all of it: the new nodes are
    drawn from by the server that holds them): the one owning most of their in-neighbours (the
    lowest among equals), so their first hop stays local; without any, the first id's owner,
    else partition 0."""
    if new.neighbors.size:
        return int(np.argmax(np.bincount(book.owners(new.neighbors), minlength=book.num_parts)))
    return int(book.owners(ids[:1])[0]) if ids.size else 0
