"""The served model one layer at a time, for layer-wise full-graph inference (the exact table).

PyG's ``BasicGNN`` computes layer ``i`` of every node from layer ``i - 1`` of its in-neighbours:
``h_i = post_i(conv_i(h_{i-1}, edge_index))`` where ``post_i`` is norm + activation (+ dropout,
a no-op in eval) for every layer but the last. :class:`LayerwiseModel` runs ``conv_i`` + ``post_i``
for a set of target nodes on their one-hop subgraph (targets first, then their other
in-neighbours; every in-edge of every target), which is all a target's output depends on. Exact
mode's rules hold: strict fp32, and GCN's full-graph normalisation (``ExactGcnNorm``) from global
degrees. The fast layers (``fast.py``) run where they apply, PyG's own convs elsewhere.

What this cannot serve (a reason from :func:`unsupported`): jumping knowledge or an output head
(the last output then depends on every layer at once), and norms that are not per node.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quiver_serve.models.fast import BatchGraph, GcnLayer, tf32_matmul
from quiver_serve.models.served import ServedModel


def unsupported(served: ServedModel) -> str | None:
    """Why layer-wise inference cannot reproduce this model, or None."""
    model = served.model
    if not served.basic_gnn:
        return f"{type(model).__name__} is not a PyG BasicGNN"
    convs = getattr(model, "convs", None)
    if convs is None or not len(convs):
        return f"{type(model).__name__} is not a PyG BasicGNN (no convs)"
    if getattr(model, "jk_mode", None) is not None or hasattr(model, "lin"):
        return "jumping knowledge / an output head"
    for norm in getattr(model, "norms", None) or []:
        if not isinstance(norm, (nn.Identity, nn.BatchNorm1d)) and \
                type(norm).__name__ not in ("BatchNorm",):
            return f"{type(norm).__name__} between layers (not a per-node norm)"
    return None


class LayerwiseModel:
    """One layer of the served model for a set of targets; see the module docstring."""

    def __init__(self, served: ServedModel) -> None:
        why = unsupported(served)
        if why is not None:
            raise ValueError(f"layer-wise inference cannot serve this model: {why}")
        self.served = served
        self.model = served.model
        self.convs = list(self.model.convs)
        self.num_layers = len(self.convs)
        #: whether a node's in-degree enters its out-edges' weights (GCN normalisation): then a
        #: changed in-list changes the layer outputs of its out-neighbours too
        self.degree_weighted = served.gcn_norm is not None

    def out_dims(self) -> list[int]:
        """Width of each layer's output."""
        dims = []
        for conv in self.convs:
            out = int(conv.out_channels)
            heads = int(getattr(conv, "heads", 1))
            dims.append(out * heads if getattr(conv, "concat", False) and heads > 1 else out)
        return dims

    @torch.no_grad()
    def forward_layer(self, i: int, x: Tensor, edge_index: Tensor, num_targets: int,
                      n_id: Tensor) -> Tensor:
        """Layer ``i``'s output (after its norm and activation unless it is the last) for the
        ``num_targets`` first rows of the subgraph: ``x`` float32 [n, F] holds the layer input
        of the subgraph's nodes ``n_id`` (global ids, targets first), ``edge_index`` every
        in-edge of the targets (local ids, targets non-decreasing)."""
        x = x.float()
        counts = [num_targets, int(n_id.numel()) - num_targets]
        fast = self.served.fast
        with tf32_matmul(False):
            if fast is not None:
                layer = fast.exact_layers[i]
                graph = BatchGraph(edge_index, counts, [int(edge_index.size(1))],
                                   fast.sparse[torch.float32]).layer(0)
                if isinstance(layer, GcnLayer):
                    out = layer(x, graph, n_id, True)
                else:
                    out = layer(x, graph)  # type: ignore[operator]
            else:
                out = self._pyg_conv(i, x, edge_index, counts, n_id)[:num_targets]
        return self._post(i, out)

    def _pyg_conv(self, i: int, x: Tensor, edge_index: Tensor, counts: list[int],
                  n_id: Tensor) -> Tensor:
        conv = self.convs[i]
        norm = self.served.gcn_norm
        if norm is not None and getattr(conv, "normalize", False):
            edges, weight, _ = norm.subgraph(n_id, edge_index, counts,
                                             [int(edge_index.size(1))], x.dtype)
            conv.normalize = False
            try:
                return conv(x, edges, edge_weight=weight)
            finally:
                conv.normalize = True
        return conv(x, edge_index)

    def _post(self, i: int, x: Tensor) -> Tensor:
        """BasicGNN's work between layers (eval mode): norm and activation, in its order."""
        if i == self.num_layers - 1:
            return x.float()
        model = self.model
        act = getattr(model, "act", None)
        act_first = bool(getattr(model, "act_first", False))
        if act is not None and act_first:
            x = act(x)
        norms = getattr(model, "norms", None)
        if norms is not None and not isinstance(norms[i], nn.Identity):
            x = norms[i](x)
        if act is not None and not act_first:
            x = act(x)
        return x.float()
