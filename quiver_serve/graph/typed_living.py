"""The living graph's rules on a typed graph: what an update names, how a record applies
(docs/architecture.md, "Typed graphs"; docs/decisions/0048-typed-updates.md).

One :class:`TypedLiveGraph` wraps the ``TypedGraph`` a process serves (the writer's copy keeps no
feature rows) and changes it in place, record by record, so every sampler and model holding the
graph reads the new relations, counts and rows at its next batch:

* an edge update names one relation ``(src, rel, dst)`` (optional on a graph of one relation)
  with (source id, destination id) pairs in the two types' own ids; that relation's CSC is
  rebuilt (``typed_splice.py``). With ``graph.add_reverse_edges`` the update is the one PyG's
  ``ToUndirected`` gives for the updated graph: a relation between two types updates its
  ``rev_`` relation with the pairs flipped, a relation within a type (made undirected, one entry
  per direction) adds or removes both directions; a ``rev_`` relation is not updated directly.
* new nodes of a type take the type's next ids; feature rows are given when the type has
  features, none (a count) when it has none.
* records carry the relation's or type's position in the graph (``TypedEdgeRecord`` ...).

A reader that keeps rows derived from the graph (an engine core's exact table) asks for
``watch_changes()``: every record applied after it adds, per node type, the nodes whose inputs
changed (feature rows written, nodes added) and the destinations whose in-edges changed (along
either direction a record changes), which ``take_changes()`` hands over.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.graph import living
from quiver_serve.graph.records import (
    TypedEdgeRecord,
    TypedFeatureRecord,
    TypedNodeRecord,
    TypedRecord,
)
from quiver_serve.graph.typed import EdgeType, TypedGraph
from quiver_serve.graph.typed_splice import grow_destinations, splice, undirected_pairs

#: the file in the update-log folder naming the typed graph the log's records were written for
META_NAME = "typed-graph.json"


def _bad(code: str, message: str, status: int = 422) -> errors.ServeError:
    return errors.ServeError(code, message, status)


def reverse_pairs(graph: TypedGraph) -> dict[EdgeType, EdgeType]:
    """Per relation ``(src, rel, dst)`` between two types, its ``(dst, rev_<rel>, src)`` when
    the graph has it (``add_reverse_edges``), in the graph's order."""
    mirror: dict[EdgeType, EdgeType] = {}
    derived: set[EdgeType] = set()
    for et in graph.edge_types:
        src, rel, dst = et
        rev = (dst, f"rev_{rel}", src)
        if et in derived or src == dst or rev not in graph.relations:
            continue
        mirror[et] = rev
        derived.add(rev)
    return mirror


@dataclasses.dataclass
class TypedChanges:
    """What records changed since the last ``take_changes`` (module docstring): per node type,
    ids whose input rows changed and ids whose in-edges changed (repeats allowed)."""

    inputs: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)
    in_edges: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)

    def add(self, kind: dict[str, list[Tensor]], node_type: str, ids: Tensor) -> None:
        if ids.numel():
            kind.setdefault(node_type, []).append(ids.reshape(-1).to(torch.int64))

    def ids(self, kind: dict[str, list[Tensor]]) -> dict[str, Tensor]:
        """Each type's ids of ``kind`` (``inputs`` or ``in_edges``), unique."""
        return {t: torch.unique(torch.cat(parts)) for t, parts in kind.items()}

    def __bool__(self) -> bool:
        return bool(self.inputs or self.in_edges)


class TypedLiveGraph:
    """A typed graph that takes updates; see the module docstring."""

    def __init__(self, graph: TypedGraph, add_reverse_edges: bool, keep_features: bool = True,
                 ) -> None:
        self.graph, self.keep_features = graph, keep_features
        self.edge_types, self.node_types = graph.edge_types, graph.node_types
        self.mirror = reverse_pairs(graph) if add_reverse_edges else {}
        self.derived = {rev: et for et, rev in self.mirror.items()}
        self.undirected = {et for et in self.edge_types if et[0] == et[2]} \
            if add_reverse_edges else set()
        self.widths = {t: graph.feature_width(t) for t in self.node_types}
        self._rows: dict[str, Tensor] = {}  # feature storage with headroom per type
        #: what records changed, for a reader keeping derived rows (None: not kept)
        self.changes: TypedChanges | None = None

    def watch_changes(self) -> None:
        """Keep what records change from now on (``take_changes``)."""
        if self.changes is None:
            self.changes = TypedChanges()

    def take_changes(self) -> TypedChanges:
        """What records changed since the last call (or ``watch_changes``; nothing when no one
        watches)."""
        if self.changes is None:
            return TypedChanges()
        out, self.changes = self.changes, TypedChanges()
        return out

    # ---- what an update names ------------------------------------------------------------------
    def edge_type_of(self, value: Any) -> EdgeType:
        """The relation an update names: required when the graph has several; a ``rev_``
        relation kept by ``add_reverse_edges`` is refused naming the one to update."""
        known = [list(et) for et in self.edge_types]
        if value is None or value == "":
            if len(self.edge_types) == 1:
                return self.edge_types[0]
            raise _bad("invalid_edge_type", f"edge_type is required: the graph's edge types are "
                       f"{known}", 400)
        key = tuple(value) if isinstance(value, list | tuple) else tuple(str(value).split("__"))
        if key not in self.graph.relations:
            raise _bad("invalid_edge_type", f"unknown edge_type {list(key)[:3]}: the graph's edge "
                       f"types are {known}", 400)
        if key in self.derived:
            raise _bad("invalid_edge_type", f"edge_type {list(key)} is the reverse of "
                       f"{list(self.derived[key])} (graph.add_reverse_edges): update that one",
                       400)
        return key  # type: ignore[return-value]

    def node_type_of(self, value: Any) -> str:
        if not value:
            if len(self.node_types) == 1:
                return self.node_types[0]
            raise _bad("invalid_node_type", "node_type is required: the graph's node types are "
                       f"{self.node_types}", 400)
        if value not in self.graph.num_nodes:
            raise _bad("invalid_node_type", f"unknown node_type {str(value)[:128]!r}: the "
                       f"graph's node types are {self.node_types}", 400)
        return str(value)

    def check_edges(self, et: EdgeType, add: np.ndarray, remove: np.ndarray) -> None:
        """Ids in the source and destination types' ranges; no additions to a relation with
        edge features (their rows are not taken)."""
        src, _, dst = et
        for field, pairs in (("add", add), ("remove", remove)):
            living.check_ids(pairs[:, 0], self.graph.num_nodes[src], f"{field} sources ({src})")
            living.check_ids(pairs[:, 1], self.graph.num_nodes[dst],
                             f"{field} destinations ({dst})")
        if len(add) and self.graph.relations[et].edge_attr is not None:
            raise _bad("invalid_edges", f"edge type {list(et)} carries edge features; adding "
                       "edges to it is not served (removals are)")

    def check_rows(self, node_type: str, rows: np.ndarray, field: str = "features",
                   ) -> np.ndarray:
        """float32 rows of ``node_type``'s width, finite; a type without features takes none."""
        width = self.widths[node_type]
        if width == 0:
            if rows.ndim == 2 and rows.shape[1] == 0:
                return np.zeros((rows.shape[0], 0), np.float32)
            raise _bad("invalid_features", f"node type {node_type!r} has no features: give "
                       f"\"count\" (new nodes) and no {field}")
        return living.as_rows(rows, f"{field} ({node_type})", width)

    # ---- records -------------------------------------------------------------------------------
    def edge_record(self, version: int, at_s: float, et: EdgeType, add: np.ndarray,
                    remove: np.ndarray) -> TypedEdgeRecord:
        return TypedEdgeRecord(version, at_s, [self.edge_types.index(et)], add, remove)

    def node_record(self, version: int, at_s: float, node_type: str, rows: np.ndarray,
                    ) -> TypedNodeRecord:
        return TypedNodeRecord(version, at_s, [self.node_types.index(node_type)], rows)

    def feature_record(self, version: int, at_s: float, node_type: str, ids: np.ndarray,
                       rows: np.ndarray) -> TypedFeatureRecord:
        return TypedFeatureRecord(version, at_s, [self.node_types.index(node_type)], ids, rows)

    def apply(self, record: TypedRecord) -> dict[str, Any]:
        """Change the graph as ``record`` says; the update call's answer (without version)."""
        key = int(record.type_key[0])
        if isinstance(record, TypedEdgeRecord):
            return self.apply_edges(self.edge_types[key], torch.from_numpy(record.add),
                                    torch.from_numpy(record.remove))
        node_type = self.node_types[key]
        if isinstance(record, TypedNodeRecord):
            return {"node_type": node_type, "node_ids": self.add_nodes(node_type,
                                                                       record.features)}
        ids = torch.from_numpy(record.node_ids)
        if self.keep_features:
            self.features(node_type)[ids] = torch.from_numpy(record.features)
        if self.changes is not None:
            self.changes.add(self.changes.inputs, node_type, ids)
        return {"node_type": node_type}

    def apply_edges(self, et: EdgeType, add: Tensor, remove: Tensor) -> dict[str, Any]:
        g = self.graph
        if et in self.undirected:
            add, remove = undirected_pairs(g.relations[et], g.num_nodes[et[0]], add, remove)
        g.relations[et], done = splice(g.relations[et], g.num_nodes[et[0]], add, remove)
        rev = self.mirror.get(et)
        if rev is not None:
            g.relations[rev], _ = splice(g.relations[rev], g.num_nodes[rev[0]], add.flip(1),
                                         remove.flip(1))
        if self.changes is not None:
            pairs = torch.cat([add.reshape(-1, 2), remove.reshape(-1, 2)])
            self.changes.add(self.changes.in_edges, et[2], pairs[:, 1])
            if rev is not None:
                self.changes.add(self.changes.in_edges, et[0], pairs[:, 0])
        return {"edge_type": list(et), "added": done.added, "removed": done.removed,
                "missing": done.missing}

    def add_nodes(self, node_type: str, rows: np.ndarray) -> list[int]:
        g, count = self.graph, int(rows.shape[0])
        first = g.num_nodes[node_type]
        if self.keep_features and node_type in g.x:
            self._grow_rows(node_type, first, torch.from_numpy(np.ascontiguousarray(rows)))
        for et, rel in g.relations.items():
            if et[2] == node_type:
                g.relations[et] = grow_destinations(rel, count)
        g.num_nodes[node_type] = first + count
        if self.changes is not None:
            self.changes.add(self.changes.inputs, node_type, torch.arange(first, first + count))
        return list(range(first, first + count))

    def features(self, node_type: str) -> Tensor:
        return self.graph.x[node_type]

    def _grow_rows(self, node_type: str, first: int, rows: Tensor) -> None:
        """Append rows in a buffer with headroom (doubling), so adding nodes one call at a time
        copies each row O(1) times; ``graph.x[type]`` is the buffer's first rows."""
        buf = self._rows.get(node_type)
        need = first + rows.size(0)
        if buf is None or buf.size(0) < need:
            grown = torch.empty((max(need, 2 * first), rows.size(1)), dtype=torch.float32)
            grown[:first] = self.graph.x[node_type]
            buf = self._rows[node_type] = grown
        buf[first:need] = rows
        self.graph.x[node_type] = buf[:need]

    # ---- what the log was written for ----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The base graph's types, counts and relations (the log's records name positions in
        them): written beside the log, compared at every start."""
        g = self.graph
        return {"node_types": {t: g.num_nodes[t] for t in self.node_types},
                "edge_types": [[*et, g.relations[et].num_edges] for et in self.edge_types],
                "reverse": sorted("__".join(et) for et in self.derived)}


def check_log_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` beside a new log; refuse a log written for another typed graph."""
    from quiver_serve.graph.base_files import write_synced

    path = Path(directory) / META_NAME
    meta = json.loads(json.dumps(meta, sort_keys=True))
    if path.exists():
        found = json.loads(path.read_text())
        if found != meta:
            raise errors.ServeError(
                "dataset_changed", f"the update log in {directory} was written for another typed "
                f"graph ({found}; this one: {meta}): its records name the old graph's types and "
                "ids; move that folder away to start over, or point graph.update_log_dir "
                "elsewhere", 500)
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_synced(path, json.dumps(meta, sort_keys=True).encode())
