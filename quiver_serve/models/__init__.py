"""PyG models built from the config and loaded weights-only."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from quiver_serve.config import REPO_ROOT, ModelConfig, resolve_path

log = logging.getLogger(__name__)

SUPPORTED_CLASSES = ("GraphSAGE", "GCN", "GAT")


def model_kwargs(cfg: ModelConfig, in_channels: int) -> dict[str, Any]:
    """Constructor kwargs of the served model, ``in_channels`` filled from the graph."""
    kwargs = dict(cfg.kwargs)
    given = kwargs.setdefault("in_channels", in_channels)
    if given != in_channels:
        raise ValueError(
            f"model.kwargs.in_channels={given} but the graph has {in_channels} features per node"
        )
    return kwargs


def build_model(cfg: ModelConfig, in_channels: int) -> nn.Module:
    """Build ``torch_geometric.nn.models.<pyg_class>(**kwargs)`` and load its weights-only state."""
    from torch_geometric.nn import models as pyg_models

    if cfg.pyg_class not in SUPPORTED_CLASSES:
        raise ValueError(f"model.pyg_class must be one of {SUPPORTED_CLASSES}, got {cfg.pyg_class!r}")
    kwargs = model_kwargs(cfg, in_channels)
    torch.manual_seed(cfg.random_init_seed)
    try:
        model = getattr(pyg_models, cfg.pyg_class)(**kwargs)
    except TypeError as exc:
        raise ValueError(f"model.kwargs do not fit {cfg.pyg_class}: {exc}") from exc
    if cfg.weights is not None:
        path = resolve_path(cfg.weights)
        if not path.exists():
            raise FileNotFoundError(f"model.weights {path} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match {cfg.pyg_class}({kwargs}): missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
    else:
        log.warning("model.weights is null: serving randomly initialised weights (seed %d)",
                    cfg.random_init_seed)
    return model.eval()


def model_metadata(cfg: ModelConfig, in_channels: int) -> dict[str, Any]:
    """How to rebuild the served model in plain PyG (KServe ``parameters``)."""
    weights = None
    if cfg.weights is not None:
        path = resolve_path(cfg.weights)
        try:
            weights = str(path.relative_to(REPO_ROOT))
        except ValueError:
            weights = str(path)
    return {
        "pyg_model": {"class": cfg.pyg_class, "kwargs": model_kwargs(cfg, in_channels)},
        "state_dict": weights,
    }


class ServedModel:
    """The model as served: forward on a sampled subgraph, trimmed per layer (PyG).

    GCN normalises by node degree. On a subgraph the boundary nodes have truncated degrees, so in
    exact mode the edge weights are computed from full-graph in-degrees (what ``gcn_norm`` computes
    on the whole graph) and the convs' own normalisation is switched off for that call. Sampled mode
    keeps PyG's mini-batch behaviour (normalise on the subgraph).
    """

    def __init__(self, model: nn.Module, in_degree: Tensor | None = None) -> None:
        from torch_geometric.nn import GCNConv

        self.model = model
        # Only convs that normalise themselves need the full-graph degrees.
        self.gcn_convs = [m for m in model.modules() if isinstance(m, GCNConv) and m.normalize]
        self.in_degree = in_degree
        if self.gcn_convs and in_degree is None:
            raise ValueError("GCN models need the graph's in-degree for exact mode")

    @property
    def out_dim(self) -> int:
        return int(self.model.out_channels)  # type: ignore[arg-type]

    def to(self, device: torch.device) -> ServedModel:
        self.model.to(device)
        if self.in_degree is not None:
            self.in_degree = self.in_degree.to(device)
        return self

    @torch.no_grad()
    def __call__(
        self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int],
        num_edges: list[int], exact: bool,
    ) -> Tensor:
        if exact and self.gcn_convs:
            return self._gcn_exact(x, n_id, edge_index, num_nodes, num_edges)
        return self.model(x, edge_index, num_sampled_nodes_per_hop=num_nodes,
                          num_sampled_edges_per_hop=num_edges)

    def _gcn_exact(
        self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int], num_edges: list[int]
    ) -> Tensor:
        conv = self.gcn_convs[0]
        fill = 2.0 if conv.improved else 1.0
        assert self.in_degree is not None
        deg = self.in_degree[n_id].to(x.dtype) + (fill if conv.add_self_loops else 0.0)
        inv_sqrt = deg.pow(-0.5).masked_fill_(deg == 0, 0.0)
        blocks, weights, counts = [], [], []
        node_start, edge_start = 0, 0
        for hop, n_edges in enumerate(num_edges):
            block = edge_index[:, edge_start:edge_start + n_edges]
            w = inv_sqrt[block[0]] * inv_sqrt[block[1]]
            if conv.add_self_loops:  # targets of block `hop` are the nodes first reached at `hop`
                loops = torch.arange(node_start, node_start + num_nodes[hop], device=x.device)
                block = torch.cat([block, loops.expand(2, -1)], dim=1)
                w = torch.cat([w, fill * inv_sqrt[loops] ** 2])
            blocks.append(block)
            weights.append(w)
            counts.append(block.size(1))
            node_start += num_nodes[hop]
            edge_start += n_edges
        for c in self.gcn_convs:
            c.normalize = False
        try:
            return self.model(x, torch.cat(blocks, dim=1), edge_weight=torch.cat(weights),
                              num_sampled_nodes_per_hop=num_nodes, num_sampled_edges_per_hop=counts)
        finally:
            for c in self.gcn_convs:
                c.normalize = True
