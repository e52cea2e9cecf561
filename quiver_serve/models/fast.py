"""The served forward of PyG's GraphSAGE, GCN and GAT on sampled subgraphs, computed faster.

Same results as PyG's own layers (fp32: to float rounding), less work:

* per-layer trimming to the rows that are used: layer ``i`` of ``L`` computes outputs only for
  the nodes of hops ``0 .. L-1-i`` (PyG's trimming also computes the last hop's rows, which the
  next layer drops);
* one CSR per batch: the sampler emits edges grouped by target in node order (docs/architecture.md,
  "Sampling": hop ``l``'s edges in frontier order, frontiers in ``n_id`` order), so the in-edges of
  the targets of every layer are a prefix of one CSR built once per batch, without a sort;
* aggregation as a sparse-dense product over that CSR (cuSPARSE SpMM on the GPU): no ``E x F``
  message tensor is materialised; sampled fp32 GraphSAGE layers on a GPU aggregate with one
  kernel instead (``csr_kernel.py``: a batch's forward is bound by its host launch cost);
* transform-then-aggregate where the algebra allows it (mean/sum aggregation and GCN are linear):
  projecting to the output width before aggregating moves ``out/in`` of the bytes; a node with no
  sampled neighbour still gets ``0`` from the aggregation and the bias is added after it, as in
  PyG;
* no host synchronisation: every shape comes from the per-hop counts the sampler reports, so
  the forward can be captured in a CUDA graph (``graphed.py``) for GCN and GAT too;
* few launches: a launch costs the host 2-3 times more while the GPU computes the batch before,
  so the bias (and a following ReLU) ride in the matmul's epilogue, the
  CSR's row bounds are a slice of a cached range, and all-GraphSAGE models keep 64-bit ids (no
  conversions for cuSPARSE, which the aggregation kernel does not use);
* precision as a config option: fp32, TF32 matmuls, or bf16/fp16 weights and activations.

:class:`FastGNN` is built from a PyG model and returns ``None`` (serve with PyG) for any layer
configuration it does not reproduce; the engine also checks it against PyG at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quiver_serve.models import csr_kernel
from quiver_serve.models.exact_gcn import ExactGcnNorm, improved_applies_without_weights

log = logging.getLogger(__name__)

#: config name -> (dtype of weights and activations, TF32 matmuls)
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
}


@contextlib.contextmanager
def tf32_matmul(enabled: bool) -> Iterator[None]:
    """TF32 for cuBLAS matmuls inside the block only (exact mode stays strict fp32)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# ---- the batch's CSR ---------------------------------------------------------------------------
@dataclass
class LayerGraph:
    """The edges one layer aggregates: in-edges of its ``num_dst`` targets (a CSR prefix)."""

    num_dst: int
    num_src: int
    rowptr: Tensor  # [num_dst + 1]
    col: Tensor  # [E] source row of each edge
    dst: Tensor  # [E] target row of each edge (non-decreasing)
    batch: BatchGraph

    @property
    def num_edges(self) -> int:
        return int(self.col.numel())


#: cached ranges per (device, dtype); every one made stays referenced (a CUDA graph or another
#: stream may still read a slice of a smaller one)
_RANGES: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}


def row_bounds(num_rows: int, like: Tensor) -> Tensor:
    """``0 .. num_rows`` in ``like``'s dtype and device: a slice of one cached range (no launch),
    or a fresh range inside a CUDA-graph capture (the graph must not read a shared buffer)."""
    if like.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.arange(num_rows + 1, dtype=like.dtype, device=like.device)
    made = _RANGES.setdefault((like.device, like.dtype), [])
    if not made or made[-1].numel() <= num_rows:
        size = max(num_rows + 1, 2 * made[-1].numel() if made else 4096)
        made.append(torch.arange(size, dtype=like.dtype, device=like.device))
    return made[-1][:num_rows + 1]


class BatchGraph:
    """Per-batch structure shared by every layer: the CSR over all expanded nodes.

    ``edge_index`` must hold the sampler's edges (row 0 source, row 1 target) with targets
    non-decreasing, which every sampler of this project guarantees (module docstring).
    """

    def __init__(self, edge_index: Tensor, num_nodes: list[int], num_edges: list[int],
                 use_sparse: bool, fused: Callable[..., Tensor] | None = None) -> None:
        self.num_nodes = num_nodes
        self.num_edges = num_edges
        self.num_layers = len(num_edges)
        self.use_sparse = use_sparse
        #: the sampled layers' aggregation kernel (``csr_kernel.py``); None: ``aggregate``
        self.fused = fused
        num_dst = sum(num_nodes[:-1])
        idx = torch.int32 if use_sparse else torch.int64  # cuSPARSE is fastest with 32-bit ids
        self.col = edge_index[0].to(idx)
        self.dst = edge_index[1]
        # targets are non-decreasing: row v's edges start where the first target >= v is
        self.rowptr = torch.searchsorted(self.dst, row_bounds(num_dst, self.dst),
                                         out_int32=idx == torch.int32)
        self._in_count: Tensor | None = None
        self._loop: Tensor | None = None

    @property
    def in_count(self) -> Tensor:
        """int64 [num_dst]: in-edges of each target."""
        if self._in_count is None:
            self._in_count = (self.rowptr[1:] - self.rowptr[:-1]).to(torch.int64)
        return self._in_count

    @property
    def is_loop(self) -> Tensor:
        """bool [E]: the edge is a self loop (a node sampled as its own neighbour)."""
        if self._loop is None:
            self._loop = self.col.to(torch.int64) == self.dst
        return self._loop

    def layer(self, i: int) -> LayerGraph:
        """Layer ``i`` (0 = the input layer): targets = hops ``0 .. L-1-i``."""
        hops = self.num_layers - i
        num_dst = sum(self.num_nodes[:hops])
        e = sum(self.num_edges[:hops])
        return LayerGraph(num_dst, num_dst + self.num_nodes[hops], self.rowptr[:num_dst + 1],
                          self.col[:e], self.dst[:e], self)


def aggregate(g: LayerGraph, values: Tensor | None, dense: Tensor) -> Tensor:
    """``out[v] = sum over in-edges e of v: values[e] * dense[col[e]]`` for the layer's targets."""
    if g.num_edges == 0:  # no in-edge at all (isolated targets): cuSPARSE refuses an empty CSR
        return dense.new_zeros((g.num_dst, dense.size(1)))
    # cuSPARSE also refuses more entries than rows x columns, which repeated edges (a multigraph)
    # reach in small layers; the gather + index_add path takes any
    if g.batch.use_sparse and g.num_edges <= g.num_dst * dense.size(0):
        vals = values if values is not None else dense.new_ones(g.num_edges)
        # cuSPARSE reads values and rows with unit stride: a head's column of GAT's [E, H]
        # weights (or [N, H, C] rows) must be made contiguous first
        adj = torch.sparse_csr_tensor(g.rowptr, g.col, vals.to(dense.dtype).contiguous(),
                                      (g.num_dst, dense.size(0)), check_invariants=False)
        return torch.sparse.mm(adj, dense.contiguous())
    msg = dense.index_select(0, g.col)
    if values is not None:
        msg = msg * values.to(dense.dtype).unsqueeze(-1)
    out = dense.new_zeros((g.num_dst, dense.size(1)))
    return out.index_add_(0, g.dst, msg)


# ---- layers ----------------------------------------------------------------------------------
#: achieved dense-matmul FLOP/s and aggregation bytes/s, by device type, dtype and TF32: what
#: decides whether a linear layer projects before or after it aggregates. fp32 on the GPU is
#: fitted to the measured crossover (bench/engine/model.py, GraphSAGE [25,10] 602->256: aggregating
#: first wins by 0.47 / 0.16 ms at 1,536 / 4,096 seeds, projecting first by 0.27 / 1.0 ms at
#: 8,192 / 16,384); tensor-core rates are that times their usual speed-up. Only ratios matter.
RATES: dict[tuple[str, torch.dtype, bool], tuple[float, float]] = {
    ("cuda", torch.float32, False): (48e12, 1.8e12),
    ("cuda", torch.float32, True): (200e12, 1.8e12),
    ("cuda", torch.bfloat16, False): (400e12, 1.8e12),
    ("cuda", torch.float16, False): (400e12, 1.8e12),
}
CPU_RATES = (1e11, 1e10)


def device_rates(x: Tensor) -> tuple[float, float]:
    tf32 = x.is_cuda and torch.backends.cuda.matmul.allow_tf32 and x.dtype == torch.float32
    return RATES.get((x.device.type, x.dtype, tf32), CPU_RATES)


def _t(w: Tensor, dtype: torch.dtype) -> Tensor:
    return w.detach().t().contiguous().to(dtype)


class SageLayer:
    """``SAGEConv`` (mean or sum aggregation, optional root weight, bias and L2 normalisation)."""

    def __init__(self, conv: nn.Module, dtype: torch.dtype) -> None:
        self.mean = conv.aggr == "mean"
        self.w_l = _t(conv.lin_l.weight, dtype)  # [in, out]
        self.b = None if conv.lin_l.bias is None else conv.lin_l.bias.detach().to(dtype)
        self.w_r = _t(conv.lin_r.weight, dtype) if conv.root_weight else None
        self.normalize = bool(conv.normalize)
        self.order = "auto"  # or "transform" / "aggregate" (benchmarks force one)

    @staticmethod
    def supports(conv: nn.Module) -> str | None:
        if conv.aggr not in ("mean", "sum") or conv.project or not isinstance(conv.aggr, str):
            return f"SAGEConv(aggr={conv.aggr!r}, project={conv.project})"
        return None

    def __call__(self, x: Tensor, g: LayerGraph, relu: bool = False) -> Tensor:
        """The layer's rows for ``g``'s targets; ``relu``: with the ReLU that follows it."""
        if self._transform_first(x, g):
            out = self._aggregate(g, x @ self.w_l)
            if self.w_r is not None:
                out = torch.addmm(out, x[:g.num_dst], self.w_r)
            if self.b is not None:
                out = out + self.b
        elif self.w_r is not None:  # one GEMM: [agg | x_dst] @ [W_l ; W_r]
            agg = self._aggregate(g, x)
            out = self._linear(torch.cat([agg, x[:g.num_dst]], dim=1), self._w_lr(), relu)
            relu = relu and self.normalize  # else applied in the GEMM
        else:
            out = self._linear(self._aggregate(g, x), self.w_l, relu)
            relu = relu and self.normalize
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return torch.relu(out) if relu else out

    def _linear(self, h: Tensor, w: Tensor, relu: bool) -> Tensor:
        """``h @ w + b`` in one launch (the bias in the GEMM's epilogue), with the ReLU too
        when asked and no normalisation comes between (the caller applies it otherwise)."""
        fuse = relu and not self.normalize
        if self.b is None:
            return torch.relu(h @ w) if fuse else h @ w
        return torch._addmm_activation(self.b, h, w) if fuse else torch.addmm(self.b, h, w)

    def _aggregate(self, g: LayerGraph, dense: Tensor) -> Tensor:
        """Sum or mean of the in-neighbours' rows: one kernel for fp32 sampled layers on a GPU
        (``g.batch.fused``), else per-edge weights through ``aggregate``."""
        fused = g.batch.fused
        if fused is not None and dense.dtype == torch.float32:
            return fused(g.rowptr, g.col, dense, g.num_dst, self.mean)
        values = None
        if self.mean:
            inv = 1.0 / g.batch.in_count[:g.num_dst].clamp(min=1).to(torch.float32)
            values = inv.index_select(0, g.dst)
        return aggregate(g, values, dense)

    def _transform_first(self, x: Tensor, g: LayerGraph) -> bool:
        """Project then aggregate, or aggregate then project: whichever the device's rates say
        is cheaper for this layer's shapes (host-side arithmetic on known sizes, no sync).
        Projecting first multiplies every source row (not only the targets) but aggregates
        ``out``-wide rows instead of ``in``-wide ones."""
        if self.order != "auto":
            return self.order == "transform"
        d_in, d_out = self.w_l.shape
        flop_s, byte_s = device_rates(x)
        size = x.element_size()
        roots = g.num_dst * d_in * d_out * 2 if self.w_r is not None else 0
        first = (g.num_src * d_in * d_out * 2 + roots) / flop_s + g.num_edges * d_out * size / byte_s
        after = (g.num_dst * d_in * d_out * 2 + roots) / flop_s + g.num_edges * d_in * size / byte_s
        return first <= after

    def _w_lr(self) -> Tensor:
        if getattr(self, "_lr", None) is None:
            assert self.w_r is not None
            self._lr = torch.cat([self.w_l, self.w_r], dim=0)
        return self._lr


class GcnLayer:
    """``GCNConv`` (projection, symmetric normalisation with self loops, bias).

    Exact mode reads ``exact.degree`` and ``exact.loop_weight`` at every call, never a copy: the
    :class:`ExactGcnNorm` is shared with ``ServedModel``, whose ``update_degrees`` writes it in
    place as the graph changes."""

    def __init__(self, conv: nn.Module, dtype: torch.dtype, exact: ExactGcnNorm | None) -> None:
        self.w = _t(conv.lin.weight, dtype)
        self.b = None if conv.bias is None else conv.bias.detach().to(dtype)
        self.normalize = bool(conv.normalize)
        self.self_loops = bool(conv.add_self_loops) and self.normalize
        self.exact = exact

    @staticmethod
    def supports(conv: nn.Module) -> str | None:
        if conv.normalize and conv.add_self_loops and conv.improved \
                and improved_applies_without_weights():
            return "GCNConv(improved=True) on a PyG that fills loops with 2"
        return None

    def __call__(self, x: Tensor, g: LayerGraph, n_id: Tensor, exact: bool) -> Tensor:
        h = x @ self.w
        if not self.normalize:
            out = aggregate(g, None, h)
        else:
            dinv, loop_w = self._inv_sqrt_degree(g, n_id, exact)
            keep = (~g.batch.is_loop[:g.num_edges]).to(torch.float32) if self.self_loops else 1.0
            values = dinv.index_select(0, g.col.to(torch.int64)) * keep * dinv[g.dst]
            out = aggregate(g, values, h)
            if self.self_loops:
                coef = loop_w * dinv[:g.num_dst] * dinv[:g.num_dst]
                out = out + coef.to(h.dtype).unsqueeze(-1) * h[:g.num_dst]
        return out + self.b if self.b is not None else out

    def _inv_sqrt_degree(self, g: LayerGraph, n_id: Tensor,
                         exact: bool) -> tuple[Tensor, Tensor | float]:
        """deg^-1/2 of every source row as ``gcn_norm`` computes it, and the loop weights."""
        if exact:
            assert self.exact is not None
            ids = n_id[:g.num_src]
            deg = self.exact.degree.index_select(0, ids)
            lw = self.exact.loop_weight
            loop_w: Tensor | float = 1.0 if lw is None else lw.index_select(0, ids[:g.num_dst])
        else:  # gcn_norm on the trimmed subgraph: in-edges within the layer (+ one loop)
            deg = g.batch.in_count[:g.num_dst].to(torch.float32)
            if self.self_loops:
                loops = torch.zeros(g.num_dst, device=deg.device).index_add_(
                    0, g.dst, g.batch.is_loop[:g.num_edges].to(torch.float32))
                deg = deg - loops + 1.0
            rest = deg.new_full((g.num_src - g.num_dst,), 1.0 if self.self_loops else 0.0)
            deg = torch.cat([deg, rest])
            loop_w = 1.0
        dinv = deg.pow(-0.5)
        return dinv.masked_fill_(deg == 0, 0.0), loop_w


class GatLayer:
    """``GATConv`` (v1: shared projection, additive attention, self loops, concat or mean)."""

    def __init__(self, conv: nn.Module, dtype: torch.dtype) -> None:
        self.heads, self.ch = conv.heads, conv.out_channels
        self.w = _t(conv.lin.weight, dtype)
        self.att_src = conv.att_src.detach().to(dtype)  # [1, H, C]
        self.att_dst = conv.att_dst.detach().to(dtype)
        self.b = None if conv.bias is None else conv.bias.detach().to(dtype)
        self.concat = bool(conv.concat)
        self.slope = float(conv.negative_slope)
        self.self_loops = bool(conv.add_self_loops)

    @staticmethod
    def supports(conv: nn.Module) -> str | None:
        if conv.lin is None or conv.edge_dim is not None or getattr(conv, "res", None) is not None:
            return "GATConv with bipartite weights, edge features or a residual"
        return None

    def __call__(self, x: Tensor, g: LayerGraph) -> Tensor:
        nd, heads = g.num_dst, self.heads
        h = (x @ self.w).view(-1, heads, self.ch)
        a_src = (h * self.att_src).sum(-1).float()  # [N, H]; softmax in fp32
        a_dst = (h[:nd] * self.att_dst).sum(-1).float()
        col = g.col.to(torch.int64)
        e = F.leaky_relu(a_src.index_select(0, col) + a_dst.index_select(0, g.dst), self.slope)
        if self.self_loops:  # gcn-style: existing loops replaced by one loop per node
            e = e.masked_fill(g.batch.is_loop[:g.num_edges].unsqueeze(-1), float("-inf"))
            e_self = F.leaky_relu(a_src[:nd] + a_dst, self.slope)
        top = e.new_full((nd, heads), float("-inf")).scatter_reduce_(
            0, g.dst.unsqueeze(-1).expand(-1, heads), e, "amax")
        if self.self_loops:
            top = torch.maximum(top, e_self)
        p = torch.exp(e - top.index_select(0, g.dst))
        total = e.new_zeros((nd, heads)).index_add_(0, g.dst, p)
        if self.self_loops:
            p_self = torch.exp(e_self - top)
            total = total + p_self
        alpha = p / (total.index_select(0, g.dst) + 1e-16)
        out = torch.stack([aggregate(g, alpha[:, k], h[:, k]) for k in range(heads)], dim=1)
        if self.self_loops:
            a_self = (p_self / (total + 1e-16)).to(h.dtype)
            out = out + a_self.unsqueeze(-1) * h[:nd]
        out = out.reshape(nd, heads * self.ch) if self.concat else out.mean(dim=1)
        return out + self.b if self.b is not None else out


# ---- the model ---------------------------------------------------------------------------------
class FastGNN:
    """The fast forward of a PyG ``BasicGNN`` (GraphSAGE, GCN, GAT); see the module docstring.

    Sampled batches run in the configured precision; exact mode always runs strict fp32.
    """

    def __init__(self, layers: list[list[object]], act: nn.Module | None, precision: str,
                 sparse: dict[torch.dtype, bool]) -> None:
        self.layers = layers[0]  # in the serving precision
        self.exact_layers = layers[1] if len(layers) > 1 else layers[0]  # fp32
        self.act = act
        self.dtype, self.tf32 = PRECISIONS[precision]
        self.precision = precision
        self.sparse = sparse  # per dtype: does CSR x dense run here (else index_add)
        #: sampled fp32 layers on a GPU aggregate with ``csr_kernel`` (benches turn it off)
        self.fused_aggregation = True

    @classmethod
    def from_pyg(cls, model: nn.Module, precision: str = "fp32",
                 gcn_norm: ExactGcnNorm | None = None,
                 device: torch.device | None = None) -> FastGNN | None:
        """The fast twin of ``model`` on ``device``, or None (logged) where it has no twin."""
        if precision not in PRECISIONS:
            raise ValueError(f"inference.precision must be one of {sorted(PRECISIONS)}, "
                             f"got {precision!r}")
        why = _unsupported(model)
        if why is not None:
            log.info("fast model path off, serving with PyG's layers: %s", why)
            return None
        dev = device or next(model.parameters()).device
        dtype = PRECISIONS[precision][0]
        dtypes = [dtype] if dtype == torch.float32 else [dtype, torch.float32]
        layers = [[_layer(c, d, gcn_norm) for c in model.convs] for d in dtypes]
        sparse = {d: sparse_mm_works(dev, d) for d in dtypes}
        return cls(layers, model.act, precision, sparse).to(dev)

    def to(self, device: torch.device | str) -> FastGNN:
        device = torch.device(device)
        for layer in {id(x): x for x in [*self.layers, *self.exact_layers]}.values():
            for name, value in vars(layer).items():
                if isinstance(value, Tensor):
                    setattr(layer, name, value.to(device))
        if device.type == "cuda" and self.fused_aggregation:  # compiled now, not in a capture
            index = device.index
            csr_kernel.kernel_for(torch.cuda.current_device() if index is None else index)
        return self  # a GCN layer's ExactGcnNorm is shared with ServedModel, which moves it

    def fits(self, num_nodes: list[int]) -> bool:
        return len(num_nodes) == len(self.layers) + 1

    @torch.no_grad()
    def __call__(self, x: Tensor, n_id: Tensor, edge_index: Tensor, num_nodes: list[int],
                 num_edges: list[int], exact: bool = False) -> Tensor:
        """Rows of the batch's hop-0 nodes (the seeds), float32."""
        layers = self.exact_layers if exact else self.layers
        dtype = torch.float32 if exact else self.dtype
        fused = None
        if self.fused_aggregation and x.is_cuda and dtype == torch.float32 and not exact:
            fused = csr_kernel.kernel_for(x.device.index)  # sampled: in-degrees <= the fanout
        all_sage = all(isinstance(layer, SageLayer) for layer in layers)
        # the kernel reads 64-bit ids as well: no conversion for cuSPARSE, which no layer uses
        sparse = self.sparse[dtype] and not (fused is not None and all_sage)
        graph = BatchGraph(edge_index, num_nodes, num_edges, sparse, fused)
        x = x.to(dtype)
        relu = isinstance(self.act, nn.ReLU)
        with tf32_matmul(self.tf32 and not exact):
            for i, layer in enumerate(layers):
                g = graph.layer(i)
                act = i < len(layers) - 1 and self.act is not None
                if isinstance(layer, SageLayer):
                    x = layer(x, g, relu=act and relu)
                    act = act and not relu
                elif isinstance(layer, GcnLayer):
                    x = layer(x, g, n_id, exact)
                else:
                    x = layer(x, g)  # type: ignore[operator]
                if act:
                    x = self.act(x)  # type: ignore[misc]
        return x.float()


def _unsupported(model: nn.Module) -> str | None:
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    convs = getattr(model, "convs", None)
    if convs is None or not len(convs):
        return f"{type(model).__name__} is not a PyG BasicGNN"
    if getattr(model, "jk_mode", None) is not None or hasattr(model, "lin"):
        return "jumping knowledge / an output head"
    if any(not isinstance(n, nn.Identity) for n in getattr(model, "norms", [])):
        return "normalisation layers between convs"
    if getattr(model, "act_first", False):
        return "act_first=True"
    for conv in convs:
        kinds = {SAGEConv: SageLayer, GCNConv: GcnLayer, GATConv: GatLayer}
        kind = kinds.get(type(conv))
        if kind is None:
            return f"{type(conv).__name__} has no fast twin"
        why = kind.supports(conv)
        if why is not None:
            return why
    return None


def _layer(conv: nn.Module, dtype: torch.dtype, gcn_norm: ExactGcnNorm | None) -> object:
    from torch_geometric.nn import GATConv, GCNConv

    if isinstance(conv, GCNConv):
        return GcnLayer(conv, dtype, gcn_norm)
    if isinstance(conv, GATConv):
        return GatLayer(conv, dtype)
    return SageLayer(conv, dtype)


def sparse_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.sparse.mm`` (CSR x dense) runs here in ``dtype`` (else index_add)."""
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    try:
        crow = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        col = torch.tensor([1, 0], dtype=torch.int32, device=device)
        adj = torch.sparse_csr_tensor(crow, col, torch.ones(2, dtype=dtype, device=device), (2, 2),
                                      check_invariants=False)
        dense = torch.arange(4, dtype=dtype, device=device).view(2, 2)
        got = torch.sparse.mm(adj, dense)
        return bool(torch.equal(got.float().cpu(), torch.tensor([[2.0, 3.0], [0.0, 1.0]])))
    except (RuntimeError, NotImplementedError):
        return False
