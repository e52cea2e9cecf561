"""A model served on a typed graph (docs/architecture.md, "Typed graphs"): built from a
:class:`ModelSpec` and the graph's metadata, its lazy input widths set by one forward on a probe
subgraph, then its weights loaded weights-only.

What can be served:

* ``to_hetero: {aggr}``: the configured PyG class (``GraphSAGE``, ``GAT``, ... or an import path)
  converted with ``torch_geometric.nn.to_hetero(model, metadata, aggr)``; ``in_channels``
  defaults to ``-1`` (lazy).
* A typed module by import path whose forward takes ``(x_dict, edge_index_dict)``, and
  ``edge_attr_dict`` and ``n_id_dict`` (global ids per type, for embedding tables) when it names
  them; ``metadata`` is passed when its constructor takes it (``models/typed_zoo.py``: HGT, RGCN,
  HeteroConv stacks).
* A homogeneous model on a one-type graph, with the relation's edge features as ``edge_attr``
  when its forward takes them (``edge_dim``: GAT, Transformer, GINE).

Node types without features get one column of ``spec.featureless_value``.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from quiver_serve.graph.typed import NAME_JOINER, EdgeType, TypedGraph
from quiver_serve.models.classes import BASIC_GNN_CLASSES, resolve_model_class
from quiver_serve.models.served import load_weights, weights_label
from quiver_serve.models.spec import ModelSpec
from quiver_serve.sampling.typed import TypedSamplerOutput

log = logging.getLogger(__name__)

#: edges per relation in the probe subgraph that sets lazy input widths
PROBE_EDGES = 4
#: BasicGNNs whose convs take one input width (no (source, destination) pair)
_SHARED_INPUT_CLASSES = ("GCN", "GIN", "PNA", "EdgeCNN")


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def check_metadata(given: Any, graph: TypedGraph, what: str) -> None:
    """ValueError naming the first node type or relation ``given`` (``(node_types,
    edge_types)``) has that ``graph`` lacks, or the other way round."""
    try:
        node_types, edge_types = given
        edge_set = {tuple(e) for e in edge_types}
    except (TypeError, ValueError):
        raise ValueError(f"{what}: metadata must be (node_types, edge_types), got "
                         f"{given!r}") from None
    for t in node_types:
        if t not in graph.num_nodes:
            raise ValueError(f"{what}: node type {t!r} is not in the graph (it has "
                             f"{graph.node_types})")
    for et in edge_set:
        if et not in graph.relations:
            raise ValueError(f"{what}: relation {list(et)} is not in the graph (it has "
                             f"{[list(e) for e in graph.edge_types]})")
    for et in graph.edge_types:
        if et not in edge_set:
            raise ValueError(f"{what}: the graph's relation {list(et)} is not in the model's "
                             "metadata")


def typed_kwargs(spec: ModelSpec, graph: TypedGraph, cls: type[nn.Module]) -> dict[str, Any]:
    """Constructor kwargs: ``metadata`` from the graph when the class takes it (a given one is
    checked), ``in_channels`` lazy (-1) under ``to_hetero`` or the only type's width, and
    ``edge_dim`` the only relation's edge-feature width when the class takes it."""
    kwargs = dict(spec.kwargs)
    takes = set(_params(cls.__init__))
    if cls.__name__ in BASIC_GNN_CLASSES:
        takes |= {"in_channels", "edge_dim"}
    if "metadata" in takes:
        if "metadata" in kwargs:
            check_metadata(kwargs["metadata"], graph, spec.label)
        else:
            kwargs["metadata"] = graph.metadata()
    if "in_channels" in takes and "in_channels" not in kwargs:
        if spec.to_hetero is not None:
            # a pair: the source and destination types of a relation may differ in width
            kwargs["in_channels"] = -1 if cls.__name__ in _SHARED_INPUT_CLASSES else (-1, -1)
        elif len(graph.node_types) == 1:
            kwargs["in_channels"] = max(1, graph.feature_width(graph.node_types[0]))
    if "edge_dim" in takes and "edge_dim" not in kwargs and len(graph.edge_types) == 1:
        attr = graph.relations[graph.edge_types[0]].edge_attr
        if attr is not None and spec.to_hetero is None:
            kwargs["edge_dim"] = int(attr.size(1))
    return kwargs


def build_typed_model(spec: ModelSpec, graph: TypedGraph) -> TypedServedModel:
    """The served model of ``spec`` on ``graph``: built, converted (``to_hetero``), its lazy
    widths set by a probe forward, its weights loaded strictly. Errors are ValueErrors naming the
    model and what is wrong (a metadata mismatch names the type or relation)."""
    cls = resolve_model_class(spec)
    params = _params(cls.forward)[1:]  # without self
    if spec.to_hetero is None and not (params and params[0].endswith("_dict")) and \
            len(graph.node_types) != 1:
        raise ValueError(
            f"{spec.label}: {spec.pyg_class}.forward takes (x, edge_index) but the graph has "
            f"node types {graph.node_types}; set model.to_hetero or serve a module taking "
            "(x_dict, edge_index_dict)")
    kwargs = typed_kwargs(spec, graph, cls)
    torch.manual_seed(spec.random_init_seed)
    try:
        model = cls(**kwargs)
    except Exception as exc:
        raise ValueError(f"{spec.label}: {spec.pyg_class}(**{kwargs}) failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    edge_features = bool(getattr(model, "supports_edge_attr", True))
    if spec.to_hetero is not None:
        from torch_geometric.nn import to_hetero

        try:
            model = to_hetero(model, graph.metadata(), aggr=spec.to_hetero.get("aggr", "sum"))
        except Exception as exc:
            raise ValueError(f"{spec.label}: to_hetero({spec.pyg_class}) failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    served = TypedServedModel(model.eval(), graph, spec, edge_features)
    served.probe()
    if spec.weights is not None:
        check_weight_names(Path(spec.weights), served.model, graph, spec.label)
        load_weights(served.model, Path(spec.weights), f"{spec.pyg_class}({kwargs})",
                     weights_label(spec))
    else:
        log.warning("%s: no weights, serving randomly initialised weights (seed %d)",
                    spec.label, spec.random_init_seed)
    return served


def check_weight_names(path: Path, model: nn.Module, graph: TypedGraph, label: str) -> None:
    """ValueError naming a relation the weights were trained with that the graph lacks, or one
    of the graph's that has no weights (a ``to_hetero`` model keys them ``src__rel__dst``)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - load_weights names the file and the cause
        return
    if not isinstance(state, dict):
        return  # load_weights says what the file holds
    in_file = _relation_names(state)
    in_model = _relation_names(model.state_dict())
    for name in sorted(in_file - in_model):
        raise ValueError(f"{label}: weights {path.name} hold relation {name.split(NAME_JOINER)} "
                         f"that the graph does not have (it has "
                         f"{[list(e) for e in graph.edge_types]})")
    for name in sorted(in_model - in_file):
        raise ValueError(f"{label}: the graph's relation {name.split(NAME_JOINER)} has no "
                         f"weights in {path.name} (trained on another metadata?)")


def _relation_names(state: dict[str, Any]) -> set[str]:
    return {part for key in state if isinstance(key, str) for part in key.split(".")
            if part.count(NAME_JOINER) == 2}


class TypedServedModel:
    """A model on typed subgraphs: builds its inputs and runs its forward (module docstring)."""

    def __init__(self, model: nn.Module, graph: TypedGraph, spec: ModelSpec,
                 edge_features: bool = True) -> None:
        self.model = model
        self.graph = graph
        self.spec = spec
        params = _params(model.forward)
        #: forward takes dicts (to_hetero, typed modules) or one tensor per argument
        self.typed = spec.to_hetero is not None or bool(params and params[0].endswith("_dict"))
        if not self.typed and len(graph.node_types) != 1:
            raise ValueError(
                f"{spec.label}: {spec.pyg_class}.forward takes (x, edge_index) but the graph has "
                f"node types {graph.node_types}; set model.to_hetero or serve a module taking "
                "(x_dict, edge_index_dict)")
        #: the forward argument that takes edge features (None: they are not passed)
        self.edge_attr_arg = next((p for p in ("edge_attr_dict", "edge_attr") if p in params),
                                  None) if edge_features else None
        self.takes_ids = "n_id_dict" in params
        self.out_dims: dict[str, int] = {}
        #: (node type, global ids) -> that type's feature rows on the model's device, float32
        #: (a placed store, ``features/typed.py``); None: rows read from ``graph.x``
        self.gather: Callable[[str, Tensor], Tensor] | None = None
        #: an inductive request's new nodes: node type -> (their first id, their feature rows)
        self.virtual_rows: dict[str, tuple[int, Tensor]] = {}

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (its inputs are moved there)."""
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def to(self, device: torch.device | str) -> TypedServedModel:
        self.model.to(device)
        return self

    def copy_on(self, device: torch.device | str) -> TypedServedModel:
        """A twin with its own copy of the model's weights on ``device``, reading input rows
        from ``graph.x`` (no placed store): the same answers computed there."""
        twin = TypedServedModel(copy.deepcopy(self.model).to(device), self.graph, self.spec,
                                edge_features=self.edge_attr_arg is not None)
        twin.out_dims = dict(self.out_dims)
        return twin

    def inputs(self, node: dict[str, Tensor]) -> dict[str, Tensor]:
        """The input rows of the nodes ``node`` (global ids per type), on the model's device."""
        dev, out = self.device, {}
        for t, ids in node.items():
            x = self.graph.x.get(t)
            virtual = self.virtual_rows.get(t)
            if x is not None and virtual is not None and ids.numel() \
                    and int(ids.max()) >= virtual[0]:
                out[t] = self._with_virtual(t, ids, *virtual)
                continue
            if x is not None and self.gather is not None:
                out[t] = self.gather(t, ids)
                continue
            out[t] = x[ids.to(x.device)].to(dev) if x is not None else torch.full(
                (ids.numel(), 1), float(self.spec.featureless_value), device=dev)
        return out

    def _with_virtual(self, t: str, ids: Tensor, first: int, rows: Tensor) -> Tensor:
        """Input rows of ``ids`` where those from ``first`` on are an inductive request's."""
        new = ids >= first
        known = self.inputs({t: ids[~new]})[t]
        out = torch.empty((ids.numel(), known.size(1)), dtype=known.dtype, device=self.device)
        out[~new.to(self.device)] = known
        out[new.to(self.device)] = rows[(ids[new] - first).to(rows.device)].to(
            self.device, known.dtype)
        return out

    def edge_attrs(self, e_id: dict[EdgeType, Tensor]) -> dict[EdgeType, Tensor]:
        """The edge features of the edges ``e_id`` per relation that has them, on the model's
        device."""
        out = {}
        for et, ids in e_id.items():
            attr = self.graph.relations[et].edge_attr
            if attr is not None:
                out[et] = attr[ids.to(attr.device)].to(self.device)
        return out

    @torch.no_grad()
    def forward(self, node: dict[str, Tensor], edge_index: dict[EdgeType, Tensor],
                e_id: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        """Output rows of every node of a typed subgraph (``node`` global ids per type, local
        ``edge_index`` and edge ids ``e_id`` per relation)."""
        x = self.inputs(node)
        attrs = self.edge_attrs(e_id)
        edge_index = {et: e.to(self.device) for et, e in edge_index.items()}
        if not self.typed:
            (t,), (et,) = self.graph.node_types, self.graph.edge_types
            kwargs = {"edge_attr": attrs[et]} if et in attrs and self.edge_attr_arg else {}
            return {t: self.model(x[t], edge_index[et], **kwargs)}
        kwargs: dict[str, Any] = {}
        if self.edge_attr_arg and attrs:
            kwargs[self.edge_attr_arg] = attrs
        if self.takes_ids:
            kwargs["n_id_dict"] = {t: ids.to(self.device) for t, ids in node.items()}
        return self.model(x, edge_index, **kwargs)

    def __call__(self, out: TypedSamplerOutput) -> Tensor:
        """The rows of the requested seeds (one per requested position) of a sampled subgraph."""
        rows = self.forward(out.node, out.edge_index, out.e_id)
        if out.seed_type not in rows:
            raise ValueError(f"{self.spec.label} gives no rows for node type "
                             f"{out.seed_type!r} (it gives {sorted(rows)})")
        return rows[out.seed_type][out.seed_index.to(self.device)]

    def probe(self) -> None:
        """One forward on a small subgraph holding a few edges of every relation: sets lazy
        widths and ``out_dims``; ValueError naming the model when the forward fails."""
        node, edge_index, e_id = probe_subgraph(self.graph)
        try:
            rows = self.forward(node, edge_index, e_id)
        except Exception as exc:
            raise ValueError(f"{self.spec.label}: forward failed on a probe subgraph of the "
                             f"graph's types {self.graph.node_types}: {type(exc).__name__}: "
                             f"{exc}") from exc
        self.out_dims = {t: int(v.size(1)) for t, v in rows.items() if v is not None}


def probe_subgraph(graph: TypedGraph) -> tuple[dict[str, Tensor], dict[EdgeType, Tensor],
                                               dict[EdgeType, Tensor]]:
    """Up to ``PROBE_EDGES`` edges of every relation, with their end nodes (and node 0 of
    every type) as a local subgraph: (global ids per type, edge_index, edge ids)."""
    from quiver_serve.sampling.reference import unique_first

    picked = {}
    for et, rel in graph.relations.items():
        num = min(PROBE_EDGES, rel.num_edges)
        dst = torch.searchsorted(rel.indptr, torch.arange(num), right=True) - 1
        picked[et] = (rel.indices[:num], dst, rel.edge_ids_at(0, num))
    node: dict[str, Tensor] = {}
    for t, count in graph.num_nodes.items():
        parts = [torch.arange(min(1, count))]
        parts += [src for (s, _, _), (src, _, _) in picked.items() if s == t]
        parts += [dst for (_, _, d), (_, dst, _) in picked.items() if d == t]
        node[t], _ = unique_first(torch.cat(parts))
    edge_index, e_id = {}, {}
    for et, (src, dst, ids) in picked.items():
        s_ids, d_ids = node[et[0]], node[et[2]]
        edge_index[et] = torch.stack([_locate(s_ids, src), _locate(d_ids, dst)])
        e_id[et] = ids
    return node, edge_index, e_id


def _locate(ids: Tensor, values: Tensor) -> Tensor:
    """Position of each of ``values`` in ``ids`` (every value is there)."""
    order = torch.argsort(ids)
    return order[torch.searchsorted(ids[order], values)]
