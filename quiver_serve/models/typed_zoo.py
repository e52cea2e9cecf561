"""Heterogeneous GNNs built from PyG's typed layers, served by import path
(``quiver_serve.models.typed_zoo:HGT``) like any operator module.

Each takes ``metadata`` (``(node_types, edge_types)``, filled in from the served graph when the
config leaves it out) and ``forward(x_dict, edge_index_dict)``. Each also exposes
``forward_layer(i, x_dict, edge_index_dict)`` (layer ``i`` and what follows it up to layer
``i + 1``'s input), which is what layer-wise full-graph inference needs
(``models/typed_layerwise.py``); a custom module that defines the same method gets it too.
Input widths are lazy (``-1``): they are learnt from the first forward, which the builder runs
on a probe subgraph before loading weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import HeteroConv, HGTConv, Linear, RGCNConv, SAGEConv

EdgeType = tuple[str, str, str]
Metadata = tuple[list[str], list[EdgeType]]


def _metadata(metadata: Any) -> Metadata:
    """``metadata`` as PyG wants it (a YAML config gives lists, not tuples)."""
    node_types, edge_types = metadata
    return list(node_types), [tuple(e) for e in edge_types]  # type: ignore[misc]


class _Layered(nn.Module):
    num_layers: int

    def forward(self, x_dict: dict[str, Tensor],
                edge_index_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        for i in range(self.num_layers):
            x_dict = self.forward_layer(i, x_dict, edge_index_dict)
        return x_dict

    def forward_layer(self, i: int, x_dict: dict[str, Tensor],
                      edge_index_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError


class HeteroSAGE(_Layered):
    """``HeteroConv`` of one ``SAGEConv`` per relation, summed per destination; ReLU between
    layers."""

    def __init__(self, metadata: Any, hidden_channels: int, out_channels: int,
                 num_layers: int = 2, aggr: str = "sum") -> None:
        super().__init__()
        _, edge_types = _metadata(metadata)
        self.num_layers = num_layers
        widths = [hidden_channels] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(
            HeteroConv({et: SAGEConv((-1, -1), w) for et in edge_types}, aggr=aggr)
            for w in widths)

    def forward_layer(self, i: int, x_dict: dict[str, Tensor],
                      edge_index_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        out = self.convs[i](x_dict, edge_index_dict)
        return out if i == self.num_layers - 1 else {t: v.relu() for t, v in out.items()}


class HGT(_Layered):
    """A per-type input projection, then ``HGTConv`` layers (heads ``heads``); the last layer's
    rows are projected to ``out_channels``."""

    def __init__(self, metadata: Any, hidden_channels: int, out_channels: int,
                 num_layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        node_types, _ = meta = _metadata(metadata)
        self.num_layers = num_layers
        self.inputs = nn.ModuleDict({t: Linear(-1, hidden_channels) for t in node_types})
        self.convs = nn.ModuleList(HGTConv(hidden_channels, hidden_channels, meta, heads)
                                   for _ in range(num_layers))
        self.out = Linear(hidden_channels, out_channels)

    def forward_layer(self, i: int, x_dict: dict[str, Tensor],
                      edge_index_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        if i == 0:
            x_dict = {t: self.inputs[t](x).relu() for t, x in x_dict.items()}
        out = {t: v for t, v in self.convs[i](x_dict, edge_index_dict).items() if v is not None}
        return {t: self.out(v) for t, v in out.items()} if i == self.num_layers - 1 else out


class RGCN(_Layered):
    """A per-type input projection to ``hidden_channels``, then ``RGCNConv`` layers over the
    graph flattened to one node set (one relation number per edge type, in metadata order);
    ReLU between layers."""

    def __init__(self, metadata: Any, hidden_channels: int, out_channels: int,
                 num_layers: int = 2, num_bases: int | None = None) -> None:
        super().__init__()
        node_types, self.edge_types = _metadata(metadata)
        self.num_layers = num_layers
        self.inputs = nn.ModuleDict({t: Linear(-1, hidden_channels) for t in node_types})
        widths = [hidden_channels] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(
            RGCNConv(hidden_channels if j == 0 else widths[j - 1], w, len(self.edge_types),
                     num_bases=num_bases) for j, w in enumerate(widths))

    def forward_layer(self, i: int, x_dict: dict[str, Tensor],
                      edge_index_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        if i == 0:
            x_dict = {t: self.inputs[t](x) for t, x in x_dict.items()}
        types = list(x_dict)
        offsets, start = {}, 0
        for t in types:
            offsets[t], start = start, start + x_dict[t].size(0)
        x = torch.cat([x_dict[t] for t in types])
        edges, kinds = [], []
        for r, et in enumerate(self.edge_types):
            ei = edge_index_dict.get(et)
            if ei is None or et[0] not in offsets or et[2] not in offsets:
                continue
            edges.append(torch.stack([ei[0] + offsets[et[0]], ei[1] + offsets[et[2]]]))
            kinds.append(torch.full((ei.size(1),), r, dtype=torch.int64, device=ei.device))
        edge_index = torch.cat(edges, 1) if edges else torch.empty(2, 0, dtype=torch.int64,
                                                                   device=x.device)
        edge_type = torch.cat(kinds) if kinds else torch.empty(0, dtype=torch.int64,
                                                               device=x.device)
        out = self.convs[i](x, edge_index, edge_type)
        if i < self.num_layers - 1:
            out = out.relu()
        return {t: out[offsets[t]:offsets[t] + x_dict[t].size(0)] for t in types}
