"""GCN in exact mode: PyG's full-graph ``gcn_norm`` weights, applied to a sampled subgraph.

On a subgraph the boundary nodes have truncated degrees, so ``gcn_norm`` on the subgraph is not
``gcn_norm`` on the graph. :class:`ExactGcnNorm` holds the per-node terms of the full-graph
normalisation and turns an exact-mode subgraph (every in-edge of every expanded node) into edges
and weights that reproduce ``GCN(x, edge_index)`` on the whole graph, self loops included.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def improved_applies_without_weights() -> bool:
    """Whether the installed PyG gives a node that lacks a self loop a loop of weight 2 when
    ``improved=True`` and no edge weights are passed (the served graph has none).

    PyG 2.8's ``gcn_norm`` appends the loops (``add_remaining_self_loops``) before it fills
    missing weights with ones, so ``fill_value`` never reaches an unweighted graph and
    ``improved`` changes nothing there. Exact mode must equal ``model(x, edge_index)`` on the PyG
    that is installed, so ask it instead of assuming either behaviour.
    """
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    # One edge 0->1: node 1's loop of weight w normalises to w / (1 + w), 1/2 or 2/3.
    edge_index, weight = gcn_norm(torch.tensor([[0], [1]]), None, 2, True, True)
    is_loop_of_1 = (edge_index[0] == 1) & (edge_index[1] == 1)
    return float(weight[is_loop_of_1]) > 0.6


class ExactGcnNorm:
    """Full-graph ``gcn_norm`` (source_to_target flow) for exact-mode subgraphs.

    With ``add_self_loops`` PyG (``add_remaining_self_loops``) removes every existing self loop
    and appends exactly one per node, of weight 1 where the node had at least one loop (an
    unweighted loop has weight 1) and of the fill value (2 if ``improved`` reaches unweighted
    graphs, else 1) where it had none; the degree is then the number of non-loop in-edges
    (duplicates count each time) plus that loop's weight. Without ``add_self_loops`` loops stay
    ordinary edges of weight 1 and the degree is the in-degree.

    ``capacity`` (default: the nodes given) sizes the per-node terms for nodes appended later
    (docs/architecture.md, "The living graph"): until :meth:`update` gives them edges they are
    isolated nodes, as ``gcn_norm`` sees a node without in-edges (degree = the fill loop's weight,
    or 0 without self loops). :meth:`update` writes new terms in place, so every holder of this
    object (the PyG path, the fast path, CUDA graphs captured over it) sees them.
    """

    def __init__(self, in_degree: Tensor, self_loops: Tensor | None, improved: bool,
                 add_self_loops: bool, capacity: int | None = None) -> None:
        self.add_self_loops = add_self_loops
        self.fill = 2.0 if add_self_loops and improved and improved_applies_without_weights() \
            else 1.0
        n = int(in_degree.numel())
        capacity = n if capacity is None else int(capacity)
        if capacity < n:
            raise ValueError(f"capacity {capacity} is below the {n} nodes given")
        degree, loop_weight = self._terms(in_degree, self_loops)
        self.degree = torch.cat([degree, self._isolated(capacity - n)[0]])
        # Unnormalised weight of the one loop PyG gives each node; None when it is 1 everywhere.
        self.loop_weight: Tensor | None = None
        if self.fill != 1.0:
            self.loop_weight = torch.cat([loop_weight, self._isolated(capacity - n)[1]])

    @property
    def capacity(self) -> int:
        return int(self.degree.numel())

    def _terms(self, in_degree: Tensor, self_loops: Tensor | None) -> tuple[Tensor, Tensor]:
        """(degree, loop weight) as ``gcn_norm`` computes them, float32, on the inputs' device."""
        degree = in_degree.to(torch.float32)
        loops = torch.zeros_like(in_degree) if self_loops is None else self_loops
        loop_weight = torch.where(loops > 0, 1.0, self.fill).to(torch.float32)
        if self.add_self_loops:
            degree = degree - loops.to(torch.float32) + loop_weight
        return degree, loop_weight

    def _isolated(self, count: int) -> tuple[Tensor, Tensor]:
        """(degree, loop weight) of ``count`` nodes without in-edges."""
        return self._terms(torch.zeros(count, dtype=torch.int64), None)

    def update(self, nodes: Tensor, in_degree: Tensor, self_loops: Tensor | None = None) -> None:
        """Set the terms of ``nodes`` (int64, each < ``capacity``, no repeats) from their new
        in-degree (every in-edge, duplicates and loops counted) and self-loop count (None: no
        loops).

        In place (same storage): the PyG path, the fast path and captured CUDA graphs read the
        new values. Call with no forward using this object queued or running (the engine
        drains first); GPU copies have completed when it returns, whatever stream reads next.
        """
        nodes = nodes.reshape(-1).to(torch.int64)
        if nodes.numel() == 0:
            return
        if int(nodes.min()) < 0 or int(nodes.max()) >= self.capacity:
            raise IndexError(f"node ids must lie in [0, {self.capacity})")
        in_degree = in_degree.reshape(-1)
        self_loops = None if self_loops is None else self_loops.reshape(-1)
        if in_degree.numel() != nodes.numel() or (
                self_loops is not None and self_loops.numel() != nodes.numel()):
            raise ValueError("nodes, in_degree and self_loops must have the same length")
        degree, loop_weight = self._terms(in_degree, self_loops)
        dev = self.degree.device
        self.degree.index_put_((nodes.to(dev),), degree.to(dev))
        if self.loop_weight is not None:
            self.loop_weight.index_put_((nodes.to(dev),), loop_weight.to(dev))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def to(self, device: torch.device) -> ExactGcnNorm:
        self.degree = self.degree.to(device)
        if self.loop_weight is not None:
            self.loop_weight = self.loop_weight.to(device)
        return self

    def subgraph(
        self, n_id: Tensor, edge_index: Tensor, num_nodes: list[int], num_edges: list[int],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, list[int]]:
        """Edges, normalised weights and per-hop edge counts of an exact-mode subgraph.

        Hop block ``h`` holds every in-edge of the nodes first reached at hop ``h``, so its
        self loops are exactly those nodes' loops: they are dropped and one loop per node is
        appended to the same block, which keeps PyG's per-layer trimming valid.
        """
        deg = self.degree[n_id].to(dtype)
        inv_sqrt = deg.pow(-0.5).masked_fill_(deg == 0, 0.0)
        blocks, weights, counts = [], [], []
        node_start, edge_start = 0, 0
        for hop, n_edges in enumerate(num_edges):
            block = edge_index[:, edge_start:edge_start + n_edges]
            weight = torch.ones(block.size(1), dtype=dtype, device=block.device)
            if self.add_self_loops:
                keep = block[0] != block[1]
                targets = torch.arange(node_start, node_start + num_nodes[hop], device=block.device)
                loop_w = torch.ones(targets.numel(), dtype=dtype, device=block.device)
                if self.loop_weight is not None:
                    loop_w = self.loop_weight[n_id[targets]].to(dtype)
                block = torch.cat([block[:, keep], targets.expand(2, -1)], dim=1)
                weight = torch.cat([weight[keep], loop_w])
            # Same product order as gcn_norm: inv_sqrt[row] * weight * inv_sqrt[col].
            blocks.append(block)
            weights.append(inv_sqrt[block[0]] * weight * inv_sqrt[block[1]])
            counts.append(block.size(1))
            node_start += num_nodes[hop]
            edge_start += n_edges
        if not blocks:
            return edge_index, torch.ones(0, dtype=dtype, device=edge_index.device), counts
        return torch.cat(blocks, dim=1), torch.cat(weights), counts
