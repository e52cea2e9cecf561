"""A typed graph: several node types and edge types ``(src, rel, dst)``, each relation its own CSC.

docs/architecture.md, "Typed graphs"; docs/decisions/0046-typed-graphs.md. PyG's ``HeteroData`` is
the reference representation: :meth:`TypedGraph.from_hetero_data` and
:meth:`TypedGraph.to_hetero_data` convert both ways, and every name here means what it means there.

* A node type has a count and a feature matrix, or none (its rows then come from the model, an
  embedding table, or a configured constant).
* A relation ``(src, rel, dst)`` is stored as a CSC keyed by the destination type, as the
  homogeneous :class:`~quiver_serve.graph.csc.GraphData` is: the in-neighbours (source-type ids) of
  destination ``v`` are ``indices[indptr[v]:indptr[v+1]]``, sorted by id, int64. ``edge_id[p]`` is
  the column of CSC entry ``p`` in the relation's PyG ``edge_index`` (the edge's id), so sampled
  edges carry ids and edge features (``edge_attr``, rows in edge-id order) are gathered by them.
* A homogeneous graph is the one-type case: :meth:`TypedGraph.from_graph_data` wraps a
  ``GraphData`` without copying its tensors (node type ``"node"``, relation ``"to"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from quiver_serve.graph.csc import GraphData

EdgeType = tuple[str, str, str]
#: PyG's ``to_hetero`` joins a relation's names with this; a type name may not contain it
NAME_JOINER = "__"
#: the names a one-type graph made from a ``GraphData`` uses
HOMOGENEOUS_NODE_TYPE = "node"
HOMOGENEOUS_RELATION = "to"


@dataclass
class Relation:
    """One edge type's CSC (see module docstring); ``edge_attr`` rows are in edge-id order."""

    edge_type: EdgeType
    indptr: Tensor  # int64 [num_dst + 1]
    indices: Tensor  # int64 [E] source ids
    edge_id: Tensor | None = None  # int64 [E] edge id of each CSC entry; None: the identity
    edge_attr: Tensor | None = None  # float32 [E, D] by edge id

    def __post_init__(self) -> None:
        name = "-".join(self.edge_type)
        for label, t in (("indptr", self.indptr), ("indices", self.indices),
                         ("edge_id", self.edge_id)):
            if t is not None and (t.dtype != torch.int64 or t.dim() != 1):
                raise TypeError(f"relation {name}: {label} must be a 1-D int64 tensor, got "
                                f"{t.dtype} {tuple(t.shape)}")
        if self.indptr.numel() < 1 or int(self.indptr[-1]) != self.indices.numel():
            raise ValueError(f"relation {name}: indptr[-1] must equal the {self.indices.numel()} "
                             "indices")
        if self.edge_id is not None and self.edge_id.numel() != self.indices.numel():
            raise ValueError(f"relation {name}: edge_id has {self.edge_id.numel()} entries, "
                             f"indices {self.indices.numel()}")
        if self.edge_attr is not None and self.edge_attr.size(0) != self.indices.numel():
            raise ValueError(f"relation {name}: edge_attr has {self.edge_attr.size(0)} rows for "
                             f"{self.indices.numel()} edges")

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def num_dst(self) -> int:
        return self.indptr.numel() - 1

    def degree(self) -> Tensor:
        """In-degree of every destination node along this relation (int64)."""
        return self.indptr[1:] - self.indptr[:-1]

    def edge_ids(self) -> Tensor:
        """``edge_id``, or the identity when entries are already in edge-id order."""
        return self.edge_id if self.edge_id is not None else torch.arange(self.num_edges)

    def edge_ids_at(self, start: int, stop: int) -> Tensor:
        """Edge ids of CSC entries ``start .. stop - 1``."""
        if self.edge_id is None:
            return torch.arange(start, stop)
        return self.edge_id[start:stop]

    def edge_index(self) -> Tensor:
        """The relation's PyG ``edge_index`` [2, E] in edge-id order (sources, targets)."""
        dst = torch.repeat_interleave(torch.arange(self.num_dst), self.degree())
        out = torch.empty((2, self.num_edges), dtype=torch.int64)
        ids = self.edge_ids()
        out[0, ids] = self.indices
        out[1, ids] = dst
        return out

    @classmethod
    def from_edge_index(cls, edge_type: EdgeType, edge_index: Tensor, num_src: int, num_dst: int,
                        edge_attr: Tensor | None = None) -> Relation:
        """The CSC of a PyG ``edge_index`` (row 0 sources, row 1 targets); edge ids are columns."""
        name = "-".join(edge_type)
        if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
            raise ValueError(f"relation {name}: edge_index must be an integer [2, E] tensor, got "
                             f"{tuple(edge_index.shape)} {edge_index.dtype}")
        edge_index = edge_index.to(torch.int64)
        src, dst = edge_index[0], edge_index[1]
        for label, ids, bound in (("source", src, num_src), ("destination", dst, num_dst)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bound):
                raise ValueError(f"relation {name}: a {label} id is outside [0, {bound}) (the "
                                 f"{label} type's node count)")
        # Sort by (target, source), stable, so every list is ordered by id and ties keep edge order.
        order = torch.argsort(src, stable=True)
        order = order[torch.argsort(dst[order], stable=True)]
        indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(dst, minlength=num_dst), 0, out=indptr[1:])
        attr = None if edge_attr is None else edge_attr.to(torch.float32).contiguous()
        return cls(edge_type, indptr, src[order].contiguous(), order, attr)


@dataclass
class TypedGraph:
    """Node types with counts and optional features, and relations keyed by edge type."""

    name: str
    num_nodes: dict[str, int]
    x: dict[str, Tensor]  # float32 [count, F] per featured type; absent types have none
    relations: dict[EdgeType, Relation]
    y: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.num_nodes:
            check_type_name(t, "node type")
        for t, x in self.x.items():
            if t not in self.num_nodes:
                raise ValueError(f"features for node type {t!r}, which the graph does not have "
                                 f"(node types: {sorted(self.num_nodes)})")
            if x.dim() != 2 or x.size(0) != self.num_nodes[t]:
                raise ValueError(f"node type {t!r}: x must be [{self.num_nodes[t]}, F], got "
                                 f"{tuple(x.shape)}")
        for et, rel in self.relations.items():
            src, r, dst = et
            check_type_name(r, "relation")
            for role, t in (("source", src), ("destination", dst)):
                if t not in self.num_nodes:
                    raise ValueError(f"relation {'-'.join(et)}: {role} type {t!r} is not a node "
                                     f"type (node types: {sorted(self.num_nodes)})")
            if rel.num_dst != self.num_nodes[dst]:
                raise ValueError(f"relation {'-'.join(et)}: CSC over {rel.num_dst} destinations, "
                                 f"node type {dst!r} has {self.num_nodes[dst]}")

    @property
    def node_types(self) -> list[str]:
        return list(self.num_nodes)

    @property
    def edge_types(self) -> list[EdgeType]:
        return list(self.relations)

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``(node_types, edge_types)``, as ``HeteroData.metadata()``."""
        return self.node_types, self.edge_types

    def feature_width(self, node_type: str) -> int:
        """Feature width of ``node_type`` (0: the type has no features)."""
        x = self.x.get(self.check_node_type(node_type))
        return 0 if x is None else int(x.size(1))

    def check_node_type(self, node_type: str) -> str:
        """``node_type``, or a KeyError naming the graph's node types."""
        if node_type not in self.num_nodes:
            raise KeyError(f"unknown node type {node_type!r}; this graph has "
                           f"{sorted(self.num_nodes)}")
        return node_type

    def check_edge_type(self, edge_type: EdgeType | list[str]) -> EdgeType:
        """``edge_type`` as a tuple, or a KeyError naming the graph's edge types."""
        key = tuple(edge_type)
        if key not in self.relations:
            raise KeyError(f"unknown edge type {list(key)}; this graph has "
                           f"{[list(e) for e in self.relations]}")
        return key  # type: ignore[return-value]

    def edge_index_dict(self) -> dict[EdgeType, Tensor]:
        return {et: rel.edge_index() for et, rel in self.relations.items()}

    def edge_attr_dict(self) -> dict[EdgeType, Tensor]:
        return {et: rel.edge_attr for et, rel in self.relations.items()
                if rel.edge_attr is not None}

    def to(self, device: torch.device | str) -> TypedGraph:
        """This graph with its CSCs and edge ids on ``device`` (node and edge features stay
        where they are: the feature store places them)."""
        relations = {et: Relation(et, rel.indptr.to(device), rel.indices.to(device),
                                  None if rel.edge_id is None else rel.edge_id.to(device),
                                  rel.edge_attr)
                     for et, rel in self.relations.items()}
        return TypedGraph(self.name, dict(self.num_nodes), dict(self.x), relations, dict(self.y))

    def share_memory_(self) -> TypedGraph:
        """Move every tensor to shared memory so spawned workers map it instead of copying."""
        tensors = [*self.x.values(), *self.y.values()]
        for rel in self.relations.values():
            tensors += [t for t in (rel.indptr, rel.indices, rel.edge_id, rel.edge_attr)
                        if t is not None]
        for t in tensors:
            t.share_memory_()
        return self

    def describe(self) -> str:
        nodes = ", ".join(f"{t} {n:,}" + (f" x{self.feature_width(t)}" if t in self.x else "")
                          for t, n in self.num_nodes.items())
        edges = ", ".join(f"{'-'.join(et)} {rel.num_edges:,}"
                          for et, rel in self.relations.items())
        return f"{self.name}: nodes ({nodes}); edges ({edges})"

    # ---- conversions -------------------------------------------------------------------------
    @classmethod
    def from_graph_data(cls, graph: GraphData) -> TypedGraph:
        """The one-type view of a homogeneous graph; its tensors are shared, not copied."""
        et = (HOMOGENEOUS_NODE_TYPE, HOMOGENEOUS_RELATION, HOMOGENEOUS_NODE_TYPE)
        y = {} if graph.y is None else {HOMOGENEOUS_NODE_TYPE: graph.y}
        return cls(graph.name, {HOMOGENEOUS_NODE_TYPE: graph.num_nodes},
                   {HOMOGENEOUS_NODE_TYPE: graph.x},
                   {et: Relation(et, graph.indptr, graph.indices)}, y)

    @classmethod
    def from_hetero_data(cls, data: object, name: str) -> TypedGraph:
        """Build from a PyG ``HeteroData`` (``x``, ``num_nodes``, ``y`` per node type;
        ``edge_index``, ``edge_attr`` per edge type)."""
        from torch_geometric.data import HeteroData

        if not isinstance(data, HeteroData):
            raise TypeError(f"expected a torch_geometric HeteroData, got {type(data).__name__}")
        num_nodes, xs, ys = {}, {}, {}
        for t in data.node_types:
            store = data[t]
            count = store.num_nodes
            if count is None:
                raise ValueError(f"node type {t!r} has neither x nor num_nodes")
            num_nodes[t] = int(count)
            if isinstance(store.get("x"), Tensor):
                xs[t] = store.x.as_subclass(Tensor).to(torch.float32).contiguous()
            labels = store.get("y")
            if isinstance(labels, Tensor) and labels.dim() >= 1 and labels.size(0) == count:
                ys[t] = labels.as_subclass(Tensor)
        relations = {}
        for et in data.edge_types:
            store = data[et]
            if not isinstance(store.get("edge_index"), Tensor):
                raise ValueError(f"edge type {list(et)} has no edge_index")
            attr = store.get("edge_attr")
            relations[et] = Relation.from_edge_index(
                et, store.edge_index.as_subclass(Tensor), num_nodes[et[0]], num_nodes[et[2]],
                attr.as_subclass(Tensor) if isinstance(attr, Tensor) else None)
        return cls(name, num_nodes, xs, relations, ys)

    def to_hetero_data(self) -> object:
        """The PyG ``HeteroData`` of this graph (edges in edge-id order)."""
        from torch_geometric.data import HeteroData

        data = HeteroData()
        for t, count in self.num_nodes.items():
            data[t].num_nodes = count
            if t in self.x:
                data[t].x = self.x[t]
            if t in self.y:
                data[t].y = self.y[t]
        for et, rel in self.relations.items():
            data[et].edge_index = rel.edge_index()
            if rel.edge_attr is not None:
                data[et].edge_attr = rel.edge_attr
        return data


def check_type_name(name: str, what: str) -> str:
    """``name``, or a ValueError when it is empty or holds ``__`` (``to_hetero``'s joiner)."""
    if not isinstance(name, str) or not name or NAME_JOINER in name:
        raise ValueError(f"{what} name {name!r} must be a non-empty string without "
                         f"{NAME_JOINER!r} (PyG's to_hetero joins names with it)")
    return name


def add_reverse_edges(graph: TypedGraph, merge: bool = True) -> TypedGraph:
    """What PyG's ``ToUndirected(reduce="add", merge=merge)`` makes of ``graph``: every relation
    between two types gains a reverse ``(dst, "rev_<rel>", src)`` with the same edge features; a
    relation within one type is made undirected (coalesced, duplicate features added) when
    ``merge``, else reversed as the others. A reverse relation the graph already has is refused."""
    from torch_geometric.utils import to_undirected

    relations = dict(graph.relations)
    for et, rel in graph.relations.items():
        src, r, dst = et
        edge_index = rel.edge_index()
        if src == dst and merge:
            n = graph.num_nodes[src]
            if rel.edge_attr is None:
                und = to_undirected(edge_index, num_nodes=n)
                relations[et] = Relation.from_edge_index(et, und, n, n)
            else:
                und, attr = to_undirected(edge_index, rel.edge_attr, num_nodes=n, reduce="add")
                relations[et] = Relation.from_edge_index(et, und, n, n, attr)
            continue
        rev = (dst, f"rev_{r}", src)
        if rev in graph.relations:
            raise ValueError(f"cannot add reverse relation {list(rev)}: the graph already has it")
        relations[rev] = Relation.from_edge_index(rev, edge_index.flip(0), graph.num_nodes[dst],
                                                  graph.num_nodes[src], rel.edge_attr)
    return TypedGraph(graph.name, dict(graph.num_nodes), dict(graph.x), relations,
                      dict(graph.y))


def stand_in(graph: TypedGraph) -> GraphData:
    """The one-type graph the main process of a typed daemon holds for what reads one (widths,
    counts, logs): the first node type with features (else the first type), its rows, no
    edges. The engine cores load and serve the typed graph themselves."""
    featured = [t for t in graph.node_types if t in graph.x]
    node_type = featured[0] if featured else graph.node_types[0]
    count = graph.num_nodes[node_type]
    x = graph.x.get(node_type, torch.zeros((count, 0)))
    return GraphData(graph.name, torch.zeros(count + 1, dtype=torch.int64),
                     torch.zeros(0, dtype=torch.int64), x)
