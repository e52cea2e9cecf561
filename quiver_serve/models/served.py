"""PyG models built from the config and loaded weights-only."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from quiver_serve.config import REPO_ROOT, ModelConfig, resolve_path
from quiver_serve.models.exact_gcn import ExactGcnNorm
from quiver_serve.models.fast import FastGNN

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
    """How to rebuild the served model in plain PyG (KServe ``parameters``).

    The weights file is named relative to the repository, or by its file name alone when it lies
    outside: clients learn which file, never the server's directory layout.
    """
    weights = None
    if cfg.weights is not None:
        path = resolve_path(cfg.weights).resolve()
        try:
            weights = path.relative_to(REPO_ROOT.resolve()).as_posix()
        except ValueError:
            weights = path.name
    return {
        "pyg_model": {"class": cfg.pyg_class, "kwargs": model_kwargs(cfg, in_channels)},
        "state_dict": weights,
    }


class ServedModel:
    """The model as served: forward on a sampled subgraph, trimmed per layer (PyG).

    GCN normalises by node degree. On a subgraph the boundary nodes have truncated degrees, so in
    exact mode the edge weights are PyG's full-graph ``gcn_norm`` weights (:class:`ExactGcnNorm`,
    built from the graph's in-degrees and per-node self-loop counts) and the convs' own
    normalisation is switched off for that call. Sampled mode keeps PyG's mini-batch behaviour
    (normalise on the subgraph).

    ``self_loops`` (int64 [num_nodes], :meth:`GraphData.self_loop_count`) matters only for GCN
    with ``add_self_loops``; None means the graph has no self loops. ``capacity`` sizes the
    degrees for nodes appended while serving (DESIGN §7; default: the nodes given), and
    :meth:`update_degrees` keeps them current as edges change.
    """

    def __init__(self, model: nn.Module, in_degree: Tensor | None = None,
                 self_loops: Tensor | None = None, precision: str = "fp32",
                 fast: bool = True, capacity: int | None = None) -> None:
        from torch_geometric.nn import GCNConv

        self.model = model
        gcn = [m for m in model.modules() if isinstance(m, GCNConv)]
        for conv in gcn:
            if conv.cached:
                # The cache holds the first request's subgraph; every later request has another.
                log.warning("GCN kwarg cached=True ignored: each request has its own subgraph")
                conv.cached = False
                conv._cached_edge_index = None
                conv._cached_adj_t = None
        # Only convs that normalise themselves need full-graph degrees; the rest sum over
        # in-edges, which an exact-mode subgraph holds in full.
        self.gcn_convs = [c for c in gcn if c.normalize]
        self.gcn_norm: ExactGcnNorm | None = None
        if self.gcn_convs:
            if in_degree is None:
                raise ValueError("GCN models need the graph's in-degree for exact mode")
            conv = self.gcn_convs[0]  # BasicGNN builds every conv from the same kwargs
            if conv.add_self_loops and self_loops is None:
                log.warning("GCN exact mode assumes the graph has no self loops "
                            "(no self-loop counts given)")
            self.gcn_norm = ExactGcnNorm(in_degree, self_loops, conv.improved, conv.add_self_loops,
                                         capacity)
        self.precision = precision
        self.fast: FastGNN | None = None
        if fast:
            self.fast = FastGNN.from_pyg(model, precision, self.gcn_norm,
                                         next(model.parameters()).device)
        elif precision != "fp32":
            raise ValueError("inference.precision other than fp32 needs inference.fast_model")

    @property
    def out_dim(self) -> int:
        return int(self.model.out_channels)  # type: ignore[arg-type]

    def to(self, device: torch.device) -> ServedModel:
        self.model.to(device)
        if self.gcn_norm is not None:
            self.gcn_norm.to(device)
        if self.fast is not None:
            self.fast = FastGNN.from_pyg(self.model, self.precision, self.gcn_norm, device)
        return self

    def update_degrees(self, nodes: Tensor, in_degree: Tensor,
                       self_loops: Tensor | None = None) -> None:
        """New in-degree and self-loop counts of ``nodes`` (int64, no repeats, each below the
        capacity) after an edge update, for GCN's exact normalisation; a no-op for models that
        do not normalise by degree. In place: the PyG and fast paths and captured CUDA graphs
        read the new values. Call between batches (none queued or running on the device)."""
        if self.gcn_norm is not None:
            self.gcn_norm.update(nodes, in_degree, self_loops)

    @torch.no_grad()
    def __call__(
        self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int],
        num_edges: list[int], exact: bool,
    ) -> Tensor:
        """Output rows of the subgraph's nodes; rows ``0 .. num_nodes[0]-1`` (the seeds) are the
        ones served (the fast path computes only those)."""
        if self.fast is not None and self.fast.fits(num_nodes):
            return self.fast(x, n_id, edge_index, num_nodes, num_edges, exact)
        return self.pyg(x, n_id, edge_index, num_nodes, num_edges, exact)

    @torch.no_grad()
    def check_fast(self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int],
                   num_edges: list[int], tolerance: float | None = None) -> float | None:
        """Relative error of the fast path against PyG's layers on one sampled subgraph (seed
        rows); the fast path is switched off (logged) when it exceeds ``tolerance`` (default:
        1e-4 in fp32/TF32-free runs, 5e-2 otherwise). None when there is no fast path."""
        if self.fast is None or not self.fast.fits(num_nodes):
            return None
        seeds = slice(0, num_nodes[0])
        got = self.fast(x, n_id, edge_index, num_nodes, num_edges, False)[seeds]
        want = self.pyg(x, n_id, edge_index, num_nodes, num_edges, False)[seeds].float()
        err = float((got - want).norm() / want.norm().clamp(min=1e-12))
        limit = tolerance if tolerance is not None else (
            1e-4 if self.precision == "fp32" else 5e-2)
        if not err <= limit:
            log.warning("fast model path off: relative error %.3g against PyG's layers "
                        "(limit %.3g, precision %s)", err, limit, self.precision)
            self.fast = None
        else:
            log.info("fast model path on (%s): relative error %.2g against PyG's layers",
                     self.precision, err)
        return err

    @torch.no_grad()
    def pyg(
        self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int],
        num_edges: list[int], exact: bool,
    ) -> Tensor:
        """The forward with PyG's own layers (the reference the fast path is checked against)."""
        x = x.float()  # features stored in fp16/bf16: PyG's layers hold fp32 weights
        if exact and self.gcn_norm is not None:
            return self._gcn_exact(x, n_id, edge_index, num_nodes, num_edges)
        return self.model(x, edge_index, num_sampled_nodes_per_hop=num_nodes,
                          num_sampled_edges_per_hop=num_edges)

    def _gcn_exact(
        self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int], num_edges: list[int]
    ) -> Tensor:
        assert self.gcn_norm is not None
        edges, weight, counts = self.gcn_norm.subgraph(n_id, edge_index, num_nodes, num_edges,
                                                       x.dtype)
        for c in self.gcn_convs:
            c.normalize = False
        try:
            return self.model(x, edges, edge_weight=weight, num_sampled_nodes_per_hop=num_nodes,
                              num_sampled_edges_per_hop=counts)
        finally:
            for c in self.gcn_convs:
                c.normalize = True
