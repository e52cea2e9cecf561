"""Layer-wise full-graph inference on a typed graph: every node's output, one layer at a time.

docs/architecture.md, "Typed graphs". Layer ``i`` of every node of type ``t`` is computed from
layer ``i - 1`` of its in-neighbours along every relation into ``t``, target chunk by target chunk:
a chunk's subgraph holds the targets first (in their type's list), every in-edge of every target
along every relation into ``t``, and those edges' sources. That is all a target's next layer
depends on, so the result equals PyG's ``model(x_dict, edge_index_dict)`` on the full graph.

A model is served layer by layer when it is

* ``to_hetero`` of a PyG ``BasicGNN`` (GraphSAGE, GAT, GIN, ...) without jumping knowledge or an
  output head: layer ``i`` runs each relation's conv, combines the relations into a destination
  as ``to_hetero`` does (pairwise, in metadata order; ``mean`` divides by their number), then the
  per-type norm and activation of every layer but the last; or
* any module with ``forward_layer(i, x_dict, edge_index_dict)`` and ``num_layers``
  (``models/typed_zoo.py``, or the operator's); it also gets ``edge_attr_dict`` and
  ``n_id_dict`` (global ids per type, for embedding tables) when it names them. Layer 0 starts
  from the inputs ``forward`` starts from.

Anything else is exact through sampling with every fanout ``-1`` (the whole ``L``-hop
in-neighbourhood), which :func:`unsupported` says.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor, nn

from quiver_serve.graph.typed import NAME_JOINER, EdgeType, TypedGraph
from quiver_serve.graph.typed_splice import range_positions
from quiver_serve.models.direct_convs import SageSum, direct_conv, sage_group
from quiver_serve.models.norms import rowwise_norms
from quiver_serve.models.typed_served import TypedServedModel
from quiver_serve.sampling.reference import unique_first
from quiver_serve.sampling.typed import TypedSamplerOutput

#: targets per chunk of one layer (bounds the subgraph a chunk builds)
DEFAULT_CHUNK_NODES = 1 << 16
#: layer i of (inputs per type, edge_index, edge features, global ids per type, and the rows
#: per type the caller reads of its output: the first ones, or None for all)
LayerFn = Callable[[int, dict[str, Tensor], dict[EdgeType, Tensor], dict[EdgeType, Tensor],
                    dict[str, Tensor], dict[str, int] | None], dict[str, Tensor]]


def unsupported(served: TypedServedModel) -> str | None:
    """Why this model cannot run layer by layer, or None."""
    model = served.model
    if hasattr(model, "forward_layer") and isinstance(getattr(model, "num_layers", None), int):
        return None
    if served.spec.to_hetero is None:
        return (f"{type(model).__name__} has no forward_layer(i, x_dict, edge_index_dict) and is "
                "not to_hetero of a PyG BasicGNN")
    convs = getattr(model, "convs", None)
    if not isinstance(convs, nn.ModuleList) or not all(isinstance(c, nn.ModuleDict)
                                                       for c in convs):
        return "to_hetero of a module without BasicGNN's convs"
    if hasattr(model, "lin") or hasattr(model, "jk"):
        return "jumping knowledge / an output head"
    if not rowwise_norms(model):
        return "a norm over all nodes of a graph between layers (layer_norm in graph mode, ...)"
    return None


class TypedLayerwise:
    """The served model's layers over the full typed graph (module docstring)."""

    def __init__(self, served: TypedServedModel, direct: bool = True) -> None:
        """``direct``: SAGE convs run without ``propagate`` (``inference.fast_model``); off,
        every conv is PyG's own."""
        why = unsupported(served)
        if why is not None:
            raise ValueError(f"layer-wise inference cannot serve this model: {why}")
        self.served = served
        model = served.model
        if hasattr(model, "forward_layer"):
            self.num_layers = int(model.num_layers)
            self.layer_params = set(inspect.signature(model.forward_layer).parameters)
            self.layer: LayerFn = self._module_layer
        else:
            self.num_layers = len(model.convs)
            self.layer = self._to_hetero_layer
            #: per layer and relation, the conv's direct form where it has one
            self.direct = [{name: direct_conv(conv) if direct else None
                            for name, conv in layer.items()} for layer in model.convs]
            self.use_groups = direct
            #: (layer, relation names into one type) -> their SAGE convs summed, or None
            self.groups: dict[tuple[int, tuple[str, ...]], SageSum | None] = {}

    @torch.no_grad()
    def run(self, chunk_nodes: int = DEFAULT_CHUNK_NODES) -> dict[str, Tensor]:
        """Every node's output, per node type that the model gives rows for (on the model's
        device)."""
        return self.run_layers(chunk_nodes, keep=False)[-1]

    @torch.no_grad()
    def run_layers(self, chunk_nodes: int = DEFAULT_CHUNK_NODES, keep: bool = True,
                   ) -> list[dict[str, Tensor]]:
        """Every layer's output per node type, layers 1 .. L: with ``keep`` each copied to host
        memory as float32 (the exact table's layers), else only the last, on the model's
        device. A type the model gives no rows for at a layer is left out of it."""
        graph = self.served.graph
        h = self.served.inputs({t: torch.arange(n) for t, n in graph.num_nodes.items()})
        layers = []
        for i in range(self.num_layers):
            nxt: dict[str, Tensor] = {}
            for t, count in graph.num_nodes.items():
                parts = []
                for lo in range(0, count, chunk_nodes):
                    hi = min(count, lo + chunk_nodes)
                    out = self.layer_rows(i, t, torch.arange(lo, hi), h, span=(lo, hi))
                    if out is None:
                        break
                    parts.append(out)
                if count and len(parts) == -(-count // chunk_nodes):
                    nxt[t] = torch.cat(parts)
            h = nxt
            if keep:
                layers.append({t: v.float().cpu() for t, v in h.items()})
        return layers if keep else [h]

    @torch.no_grad()
    def layer_rows(self, i: int, node_type: str, targets: Tensor, h: dict[str, Tensor] | None,
                   span: tuple[int, int] | None = None) -> Tensor | None:
        """Layer ``i``'s rows of ``targets`` (ids of ``node_type``) from ``h``, layer ``i - 1``'s
        rows of every node per type (None: the inputs), over every in-edge of the targets;
        ``span``: the targets are ``range(*span)``. None when the model gives the type no rows
        at this layer."""
        dev = self.served.device
        node, edge_index, e_id = one_hop(self.served.graph, node_type, targets, span)
        node = {s: ids.to(dev) for s, ids in node.items()}
        if h is None:
            x = self.served.inputs(node)
        else:
            x = {s: h[s][ids.to(h[s].device)].to(dev) for s, ids in node.items() if s in h}
        ei = {et: e.to(dev) for et, e in edge_index.items() if et[0] in x}
        out = self.layer(i, x, ei, self.served.edge_attrs(e_id), node,
                         {node_type: targets.numel()}).get(node_type)
        return None if out is None else out[:targets.numel()]

    @torch.no_grad()
    def sampled(self, out: TypedSamplerOutput) -> Tensor:
        """The rows of the requested seeds of a sampled subgraph, each layer run only on what it
        still needs, as PyG's ``trim_to_layer`` trims: layer ``i`` reads the nodes of the first
        ``L + 1 - i`` hops and the edges of the first ``L - i``. The seeds' rows are those of the
        untrimmed forward; the outer hops cost no compute in later layers."""
        num_layers = self.num_layers
        hops = len(next(iter(out.num_sampled_edges.values()), []))
        if hops != num_layers:
            raise ValueError(f"a {num_layers}-layer model needs a {num_layers}-hop sample, got "
                             f"{hops} hops")
        dev = self.served.device
        h = self.served.inputs(out.node)
        attrs = self.served.edge_attrs(out.e_id)
        node = {t: ids.to(dev) for t, ids in out.node.items()}
        edge_index = {et: e.to(dev) for et, e in out.edge_index.items()}
        for i in range(num_layers):
            keep = {t: sum(c[:num_layers + 1 - i]) for t, c in out.num_sampled_nodes.items()}
            x = {t: v[:keep[t]] for t, v in h.items() if keep[t] or t == out.seed_type}
            ei, ea = {}, {}
            for et, edges in edge_index.items():
                if et[0] in x and et[2] in x:
                    num = sum(out.num_sampled_edges[et][:num_layers - i])
                    ei[et] = edges[:, :num]
                    if et in attrs:
                        ea[et] = attrs[et][:num]
            reads = {t: sum(c[:num_layers - i]) for t, c in out.num_sampled_nodes.items()}
            h = self.layer(i, x, ei, ea, {t: node[t][:keep[t]] for t in x}, reads)
        return h[out.seed_type][out.seed_index.to(dev)]

    def _module_layer(self, i: int, x: dict[str, Tensor], edge_index: dict[EdgeType, Tensor],
                      edge_attr: dict[EdgeType, Tensor], node: dict[str, Tensor],
                      out_rows: dict[str, int] | None = None) -> dict[str, Tensor]:
        """The module's own ``forward_layer``, given edge features and global ids when it names
        ``edge_attr_dict`` / ``n_id_dict``."""
        kwargs: dict[str, object] = {}
        if "edge_attr_dict" in self.layer_params:
            kwargs["edge_attr_dict"] = edge_attr
        if "n_id_dict" in self.layer_params:
            kwargs["n_id_dict"] = node
        return self.served.model.forward_layer(i, x, edge_index, **kwargs)

    def _to_hetero_layer(self, i: int, x: dict[str, Tensor], edge_index: dict[EdgeType, Tensor],
                         edge_attr: dict[EdgeType, Tensor], node: dict[str, Tensor],
                         out_rows: dict[str, int] | None = None) -> dict[str, Tensor]:
        """Layer ``i`` of ``to_hetero(BasicGNN)`` (module docstring). With ``out_rows`` the
        output of type ``t`` has at least its first ``out_rows[t]`` rows (every edge's
        destination must be among them): direct convs compute only those, and the others'
        outputs are cut to them before the relations are combined. SAGE convs of every
        relation into a type, summed or averaged, run as one ``SageSum``."""
        model = self.served.model
        aggr = (self.served.spec.to_hetero or {}).get("aggr", "sum")
        into: dict[str, list[EdgeType]] = {}
        for et in edge_index:
            into.setdefault(et[2], []).append(et)
        out: dict[str, Tensor] = {}
        for dst, ets in into.items():
            rows = None if out_rows is None else out_rows.get(dst)
            x_dst = x[dst] if rows is None else x[dst][:rows]
            group = self._group(i, ets) if self.use_groups and aggr in ("sum", "mean") and \
                not any(et in edge_attr for et in ets) else None
            if group is not None:
                out[dst] = group([(x[et[0]], edge_index[et]) for et in ets], x_dst)
                out[dst] = out[dst] / len(ets) if aggr == "mean" and len(ets) > 1 else out[dst]
                continue
            parts = []
            for et in ets:
                name = NAME_JOINER.join(et)
                kwargs = {"edge_attr": edge_attr[et]} if et in edge_attr and \
                    self.served.edge_attr_arg else {}
                direct = None if kwargs else self.direct[i][name]
                if direct is not None:
                    parts.append(direct((x[et[0]], x_dst), edge_index[et]))
                    continue
                part = model.convs[i][name](x[et[0]] if et[0] == dst else (x[et[0]], x[dst]),
                                            edge_index[et], **kwargs)
                parts.append(part if rows is None else part[:rows])
            out[dst] = combine(parts, aggr)
        if i == self.num_layers - 1:
            return out
        return {t: self._post(i, t, v) for t, v in out.items()}

    def _group(self, i: int, ets: list[EdgeType]) -> SageSum | None:
        names = tuple(NAME_JOINER.join(et) for et in ets)
        if (i, names) not in self.groups:
            convs = self.served.model.convs[i]
            self.groups[(i, names)] = sage_group([convs[n] for n in names])
        return self.groups[(i, names)]

    def _post(self, i: int, t: str, x: Tensor) -> Tensor:
        """BasicGNN's work between layers (eval mode) for node type ``t``."""
        model = self.served.model
        act_first = bool(self.served.spec.kwargs.get("act_first", False))
        act = model.act[t] if isinstance(getattr(model, "act", None), nn.ModuleDict) else None
        norms = getattr(model, "norms", None)
        norm = norms[i][t] if norms is not None and isinstance(norms[i], nn.ModuleDict) else None
        if act is not None and act_first:
            x = act(x)
        if norm is not None:
            x = norm(x)
        if act is not None and not act_first:
            x = act(x)
        return x


def combine(parts: list[Tensor], aggr: str) -> Tensor:
    """The relations' outputs into one destination, as ``to_hetero`` combines them: pairwise
    from a queue in metadata order; ``mean`` sums and divides by their number."""
    ops = {"sum": torch.add, "mean": torch.add, "max": torch.max, "min": torch.min,
           "mul": torch.mul}
    queue = deque(parts)
    while len(queue) >= 2:
        a, b = queue.popleft(), queue.popleft()
        queue.append(ops[aggr](a, b))
    out = queue.popleft()
    return out / len(parts) if aggr == "mean" and len(parts) > 1 else out


def one_hop(graph: TypedGraph, node_type: str, targets: Tensor,
            span: tuple[int, int] | None = None) -> tuple[
        dict[str, Tensor], dict[EdgeType, Tensor], dict[EdgeType, Tensor]]:
    """The subgraph of ``targets`` (ids of ``node_type``; ``span``: they are ``range(*span)``,
    read as slices): global ids per type (the targets first in their type), every in-edge of
    every target per relation into the type as a local ``edge_index``, and those edges' ids."""
    parts: dict[str, list[Tensor]] = {t: [] for t in graph.node_types}
    parts[node_type].append(targets)
    picked = {}
    for et, rel in graph.relations.items():
        if et[2] != node_type:
            continue
        if span is not None:
            start, stop = int(rel.indptr[span[0]]), int(rel.indptr[span[1]])
            src, ids = rel.indices[start:stop], rel.edge_ids_at(start, stop)
            deg = rel.degree()[span[0]:span[1]]
        else:
            deg = rel.indptr[targets + 1] - rel.indptr[targets]
            pos = range_positions(rel.indptr[targets], deg)
            src, ids = rel.indices[pos], (pos if rel.edge_id is None else rel.edge_id[pos])
        dst = torch.repeat_interleave(torch.arange(targets.numel()), deg)
        offset = sum(p.numel() for p in parts[et[0]])  # where src lands in its type's list
        parts[et[0]].append(src)
        picked[et] = (offset, src.numel(), dst, ids)
    node, inverse = {}, {}
    for t, pieces in parts.items():
        if pieces:
            node[t], inverse[t] = unique_first(torch.cat(pieces))
    edge_index = {et: torch.stack([inverse[et[0]][off:off + n], dst])
                  for et, (off, n, dst, _) in picked.items()}
    e_id = {et: ids for et, (_, _, _, ids) in picked.items()}
    return node, edge_index, e_id
