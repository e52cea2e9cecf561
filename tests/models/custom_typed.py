"""Typed and edge-feature models as an operator would ship them: plain ``torch.nn.Module``
subclasses built from PyG layers, served by import path. Nothing here imports quiver_serve."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn import GINEConv, HeteroConv, Linear, TransformerConv

EdgeType = tuple[str, str, str]


class EdgeAwareHetero(nn.Module):
    """Per-type input projections, then ``HeteroConv`` of ``TransformerConv`` reading each
    relation's edge features; ``forward(x_dict, edge_index_dict, edge_attr_dict)``. No
    ``forward_layer``: exact through the whole sampled neighbourhood."""

    def __init__(self, metadata: tuple, hidden_channels: int, out_channels: int,
                 edge_dim: int) -> None:
        super().__init__()
        node_types, edge_types = metadata
        self.inputs = nn.ModuleDict({t: Linear(-1, hidden_channels) for t in node_types})
        self.conv1 = HeteroConv({tuple(et): TransformerConv(hidden_channels, hidden_channels,
                                                            edge_dim=edge_dim)
                                 for et in edge_types}, aggr="sum")
        self.conv2 = HeteroConv({tuple(et): TransformerConv(hidden_channels, out_channels,
                                                            edge_dim=edge_dim)
                                 for et in edge_types}, aggr="mean")

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                edge_attr_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        x_dict = {t: self.inputs[t](x).relu() for t, x in x_dict.items()}
        x_dict = {t: v.relu() for t, v in self.conv1(x_dict, edge_index_dict,
                                                     edge_attr_dict=edge_attr_dict).items()}
        return self.conv2(x_dict, edge_index_dict, edge_attr_dict=edge_attr_dict)


class EmbeddedAuthors(nn.Module):
    """An embedding table for a featureless type (read by ``n_id_dict``, the global ids), then
    one layer per ``forward_layer``: a sum of per-relation linear messages plus a root term."""

    def __init__(self, metadata: tuple, num_embedded: int, embedded_type: str,
                 hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        node_types, edge_types = metadata
        self.edge_types = [tuple(et) for et in edge_types]
        self.embedded_type = embedded_type
        self.embedding = nn.Embedding(num_embedded, hidden_channels)
        self.inputs = nn.ModuleDict({t: Linear(-1, hidden_channels) for t in node_types})
        self.num_layers = 2
        widths = [hidden_channels, out_channels]
        self.rel = nn.ModuleList(nn.ModuleDict({"__".join(et): Linear(hidden_channels, w)
                                                for et in self.edge_types}) for w in widths)
        self.root = nn.ModuleList(nn.ModuleDict({t: Linear(hidden_channels, w)
                                                 for t in node_types}) for w in widths)

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                n_id_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        for i in range(self.num_layers):
            x_dict = self.forward_layer(i, x_dict, edge_index_dict, n_id_dict)
        return x_dict

    def forward_layer(self, i: int, x_dict: dict[str, Tensor],
                      edge_index_dict: dict[EdgeType, Tensor],
                      n_id_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        if i == 0:
            x_dict = {t: self.inputs[t](x) for t, x in x_dict.items()}
            x_dict[self.embedded_type] = self.embedding(n_id_dict[self.embedded_type])
        out = {t: self.root[i][t](x) for t, x in x_dict.items()}
        for et, ei in edge_index_dict.items():
            msg = self.rel[i]["__".join(et)](x_dict[et[0]])[ei[0]]
            out[et[2]] = out[et[2]].index_add(0, ei[1], msg)
        return out if i == self.num_layers - 1 else {t: v.relu() for t, v in out.items()}


class GINE(nn.Module):
    """A homogeneous two-layer ``GINEConv`` network reading edge features:
    ``forward(x, edge_index, edge_attr)``."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int,
                 edge_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_channels, hidden_channels)
        self.conv1 = GINEConv(nn.Sequential(nn.Linear(hidden_channels, hidden_channels),
                                            nn.ReLU()), edge_dim=edge_dim)
        self.conv2 = GINEConv(nn.Linear(hidden_channels, out_channels), edge_dim=edge_dim)
        self.in_channels = in_channels

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor) -> Tensor:
        x = self.lin(x)
        x = torch.relu(self.conv1(x, edge_index, edge_attr))
        return self.conv2(x, edge_index, edge_attr)
