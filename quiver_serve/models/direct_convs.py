"""PyG convolutions run as their plain tensor operations, without ``MessagePassing.propagate``
(docs/architecture.md, "Typed graphs"; decision 0062).

A typed batch runs one conv per relation and layer (12 on ogbn-mag with reverse relations), and
``propagate``'s bookkeeping (collecting arguments, hooks, size checks) costs more host time per
call than a sampled batch's arithmetic on a GPU. ``direct_conv(conv)`` returns, for the convs it
knows, a function computing exactly what ``conv(x, edge_index)`` computes, with the same
operations in the same order; for any other conv (or one with hooks, explain mode or
decomposed layers, or a subclass) it returns None and the conv is called as it is.

Known: ``SAGEConv`` with mean aggregation, without ``project`` (``normalize`` and
``root_weight`` either way). ``SageSum`` adds up such convs of several relations into one node
type (``to_hetero``'s ``sum`` and ``mean``) in two matrix products.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: (x or (x_src, x_dst), edge_index [2, E]) -> the conv's output rows of the destinations
DirectConv = Callable[[Tensor | tuple[Tensor, Tensor], Tensor], Tensor]


def _plain(conv: nn.Module) -> bool:
    """No hooks or modes that make ``propagate`` do more than message, aggregate, update."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_propagate_forward_hooks",
             "_propagate_forward_pre_hooks", "_message_forward_hooks",
             "_message_forward_pre_hooks", "_aggregate_forward_hooks",
             "_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
             "_message_and_aggregate_forward_pre_hooks", "_edge_update_forward_hooks",
             "_edge_update_forward_pre_hooks")
    if any(getattr(conv, h, None) for h in hooks):
        return False
    return not getattr(conv, "explain", False) and getattr(conv, "decomposed_layers", 1) == 1


def direct_conv(conv: nn.Module) -> DirectConv | None:
    """The conv's direct form (module docstring), or None."""
    from torch_geometric.nn import SAGEConv
    from torch_geometric.nn.aggr import MeanAggregation

    if type(conv) is SAGEConv and type(conv.aggr_module) is MeanAggregation \
            and not conv.project and _plain(conv):
        return lambda x, edge_index: sage_mean(conv, x, edge_index)
    return None


def mean_rows(x_src: Tensor, edge_index: Tensor, num_dst: int) -> Tensor:
    """Per destination the mean of its sources' rows (0 without any), as PyG's ``scatter``
    with ``reduce="mean"`` computes it."""
    src, dst = edge_index[0], edge_index[1]
    msg = x_src.index_select(0, src)
    count = msg.new_zeros(num_dst)
    count.scatter_add_(0, dst, msg.new_ones(dst.numel()))
    out = msg.new_zeros((num_dst, msg.size(1)))
    out.index_add_(0, dst, msg)
    return out / count.clamp_(min=1).unsqueeze(1)


def sage_mean(conv: nn.Module, x: Tensor | tuple[Tensor, Tensor], edge_index: Tensor) -> Tensor:
    """``SAGEConv.forward`` (mean aggregation, no projection) without ``propagate``."""
    x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
    out = mean_rows(x_src, edge_index, x_dst.size(0))
    out = F.linear(out, conv.lin_l.weight, conv.lin_l.bias)
    if conv.root_weight:
        out = out + F.linear(x_dst, conv.lin_r.weight, conv.lin_r.bias)
    if conv.normalize:
        out = F.normalize(out, p=2., dim=-1)
    return out


def sage_group(convs: list[nn.Module]) -> SageSum | None:
    """``SageSum`` of the convs of the relations into one node type, when every one has a
    direct form and is not normalised (a sum of normalised outputs is not linear)."""
    if not convs or any(direct_conv(c) is None or c.normalize for c in convs):
        return None
    return SageSum(convs)


class SageSum:
    """The sum over relations of ``SAGEConv_r((x_src_r, x_dst), edge_index_r)`` into one node
    type, as two matrix products: the relations' mean rows side by side times their ``lin_l``
    weights side by side (biases summed), plus ``x_dst`` times the sum of their ``lin_r``
    weights. The same sum as the convs one by one, added in another order (float rounding).
    The stacked weights are rebuilt when a parameter changes (a load in place)."""

    def __init__(self, convs: list[nn.Module]) -> None:
        self.convs = convs
        self._key: tuple = ()
        self._w_l: Tensor | None = None
        self._bias: Tensor | None = None
        self._w_root: Tensor | None = None

    def _weights(self) -> None:
        params = [p for c in self.convs for p in (c.lin_l.weight, c.lin_l.bias,
                                                   c.lin_r.weight if c.root_weight else None)
                  if p is not None]
        key = tuple((id(p), p.data_ptr()) for p in params)
        if key == self._key:
            return
        self._w_l = torch.cat([c.lin_l.weight for c in self.convs], dim=1)
        biases = [c.lin_l.bias for c in self.convs if c.lin_l.bias is not None]
        self._bias = torch.stack(biases).sum(0) if biases else None
        roots = [c.lin_r.weight for c in self.convs if c.root_weight]
        self._w_root = torch.stack(roots).sum(0) if roots else None
        self._key = key

    def __call__(self, sources: list[tuple[Tensor, Tensor]], x_dst: Tensor) -> Tensor:
        """``sources``: per conv, in order, (its source rows, its edge_index)."""
        self._weights()
        means = [mean_rows(x_src, ei, x_dst.size(0)) for x_src, ei in sources]
        out = F.linear(means[0] if len(means) == 1 else torch.cat(means, dim=1), self._w_l,
                       self._bias)
        if self._w_root is not None:
            out = out + F.linear(x_dst, self._w_root)
        return out
