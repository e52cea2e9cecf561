"""User models as an operator would ship them in a model repository: plain ``torch.nn.Module``
subclasses with ``forward(x, edge_index)``, built from PyG message passing.

Served by import path (``tests.models.custom_gnn:WeightedGIN``) or, copied into a model's
folder, as ``custom_gnn:WeightedGIN``. Nothing here imports quiver_serve.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn import GINConv, MessagePassing


def mlp(in_channels: int, out_channels: int) -> nn.Sequential:
    """GIN's update network: two linear layers with a ReLU between them."""
    return nn.Sequential(nn.Linear(in_channels, out_channels), nn.ReLU(),
                         nn.Linear(out_channels, out_channels))


class WeightedGINLayer(MessagePassing):
    """``mlp((1 + eps) * x_i + sum_{j -> i} x_j)`` with a learnable ``eps`` per layer."""

    def __init__(self, in_channels: int, out_channels: int, eps: float = 0.0) -> None:
        super().__init__(aggr="add")
        self.mlp = mlp(in_channels, out_channels)
        self.eps = nn.Parameter(torch.tensor([eps]))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        summed = self.propagate(edge_index, x=x)
        return self.mlp((1.0 + self.eps) * x + summed)

    def message(self, x_j: Tensor) -> Tensor:
        return x_j


class WeightedGIN(nn.Module):
    """``num_layers`` :class:`WeightedGINLayer` with ReLU between them; one output row per node."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int,
                 num_layers: int = 2) -> None:
        super().__init__()
        self.out_channels = out_channels
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.layers = nn.ModuleList(
            WeightedGINLayer(widths[i], widths[i + 1], eps=0.1 * i) for i in range(num_layers))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, edge_index)
            if i < len(self.layers) - 1:
                x = x.relu()
        return x


class PlainGIN(nn.Module):
    """PyG's ``GINConv`` stacked by hand, with a linear read-out per node. No ``in_channels`` or
    ``out_channels`` attribute: its output width is only known by running it."""

    def __init__(self, in_channels: int, hidden_channels: int, embedding_dim: int,
                 num_layers: int = 2) -> None:
        super().__init__()
        widths = [in_channels] + [hidden_channels] * num_layers
        self.convs = nn.ModuleList(GINConv(mlp(widths[i], widths[i + 1]), train_eps=True)
                                   for i in range(num_layers))
        self.readout = nn.Linear(hidden_channels, embedding_dim)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return self.readout(x)


class NotAModel:
    """Not a ``torch.nn.Module``: refused by name."""

    def __init__(self, in_channels: int) -> None:
        self.in_channels = in_channels
