"""The served model: any PyG model (a class of ``torch_geometric.nn.models`` or the operator's
``package.module:Class``), built from a :class:`ModelSpec`, loaded weights-only, and run on
sampled subgraphs (:class:`ServedModel`).

Specs come only from the operator's files (the ``model:`` config section or the model
repository), never from a request: building one imports the operator's code.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor, nn

from quiver_serve.config import ModelConfig
from quiver_serve.models.classes import BASIC_GNN_CLASSES, resolve_model_class
from quiver_serve.models.exact_gcn import ExactGcnNorm
from quiver_serve.models.fast import FastGNN
from quiver_serve.models.spec import ModelSpec
from quiver_serve.paths import PACKAGE_DIR, shown_path

log = logging.getLogger(__name__)

#: the forward argument that marks PyG's per-layer trimming (``BasicGNN``)
TRIM_ARG = "num_sampled_nodes_per_hop"


# ---- building ----------------------------------------------------------------------------------
def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def model_kwargs(spec: ModelSpec | ModelConfig, in_channels: int,
                 model_cls: type[nn.Module] | None = None) -> dict[str, Any]:
    """Constructor kwargs of the served model: ``in_channels`` filled from the graph when the
    class takes it (``model_cls``; default: resolved from the spec, PyG's GNNs by name)."""
    spec = ModelSpec.coerce(spec)
    kwargs = dict(spec.kwargs)
    if model_cls is not None:
        takes = _accepts(model_cls, "in_channels")
    elif not spec.is_import_path and spec.pyg_class in BASIC_GNN_CLASSES:
        takes = True  # without importing PyG (front-end processes)
    else:
        takes = _accepts(resolve_model_class(spec), "in_channels")
    if takes or "in_channels" in kwargs:
        given = kwargs.setdefault("in_channels", in_channels)
        if given != in_channels:
            raise ValueError(f"{spec.label}: kwargs.in_channels={given} but the graph has "
                             f"{in_channels} features per node")
    return kwargs


def build_model(spec: ModelSpec | ModelConfig, in_channels: int) -> nn.Module:
    """``<class>(**kwargs)`` with its weights-only ``state_dict`` loaded, in eval mode.

    ``spec`` comes from the operator's files (a ``ModelConfig`` is taken as version 1 of the
    ``model:`` section), never from a request body: an import path runs the operator's code.
    Every way it can fail is a ValueError (FileNotFoundError for missing weights) naming the
    model, the class or the file, and what is wrong."""
    spec = ModelSpec.coerce(spec)
    cls = resolve_model_class(spec)
    kwargs = model_kwargs(spec, in_channels, cls)
    torch.manual_seed(spec.random_init_seed)
    try:
        model = cls(**kwargs)
    except Exception as exc:
        raise ValueError(f"{spec.label}: {spec.pyg_class}(**{kwargs}) failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if spec.weights is not None:
        load_weights(model, Path(spec.weights), f"{spec.pyg_class}({kwargs})",
                     weights_label(spec))
    else:
        log.warning("%s: no weights, serving randomly initialised weights (seed %d)",
                    spec.label, spec.random_init_seed)
    return model.eval()


def load_weights(model: nn.Module, path: Path, what: str, name_as: str | None = None) -> None:
    """Load the weights-only ``state_dict`` at ``path`` into ``model`` (described by ``what``
    in errors), strictly: every key present, none unexpected, shapes equal, values finite.
    Errors name the file as ``name_as`` (default: ``path``)."""
    shown = name_as or str(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights {shown} do not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{shown} cannot be loaded weights-only: {type(exc).__name__}: "
                         f"{exc}") from exc
    check_state_dict(state, shown)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes; PyG lists one per line
        lines = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ValueError(f"{shown} does not match {what}: {lines}") from exc
    if missing or unexpected:
        raise ValueError(f"{shown} does not match {what}: missing keys {missing}, "
                         f"unexpected keys {unexpected}")


def check_state_dict(state: Any, path: str) -> None:
    """``state`` maps names to tensors, every floating tensor finite (names the first bad key)."""
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a state_dict: it holds a {type(state).__name__} "
                         "(save model.state_dict())")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise ValueError(f"{path} is not a state_dict: key {key!r} holds a "
                             f"{type(value).__name__}, not a tensor (save model.state_dict())")
        if (value.is_floating_point() or value.is_complex()) and \
                not bool(torch.isfinite(value).all()):
            raise ValueError(f"{path}: tensor {key!r} holds NaN or infinite values")


def weights_label(spec: ModelSpec) -> str | None:
    """The weights file as clients may see it: the spec's relative label, else a file of the
    package from the folder holding it (``quiver_serve/defaults/cora_graphsage.pt``, the same in
    a checkout and in site-packages), else the file name alone (never the server's directories)."""
    if spec.weights is None:
        return None
    label = spec.weights_label
    if label and not PurePosixPath(label).is_absolute() and ".." not in PurePosixPath(label).parts \
            and "\\" not in label:
        return PurePosixPath(label).as_posix()
    path = Path(spec.weights).resolve()
    return shown_path(path) if path.is_relative_to(PACKAGE_DIR) else path.name


def model_metadata(spec: ModelSpec | ModelConfig, in_channels: int) -> dict[str, Any]:
    """How to rebuild the served model (KServe ``parameters``): its class, kwargs and weights
    file (:func:`weights_label`). An import path is resolved (its module imported) to learn
    whether it takes ``in_channels``; PyG's GNNs by name are not."""
    spec = ModelSpec.coerce(spec)
    return {
        "pyg_model": {"class": spec.pyg_class, "kwargs": model_kwargs(spec, in_channels)},
        "state_dict": weights_label(spec),
    }


def probe_out_dim(model: nn.Module, in_channels: int) -> int:
    """Width of ``model(x, edge_index)``'s rows, from one forward (in eval mode) on a graph of
    2 nodes and the edge 0 -> 1; ValueError when the forward fails or returns no
    ``[num_nodes, dim]``."""
    device = _device_of(model)
    x = torch.zeros(2, in_channels, device=device)
    edge_index = torch.tensor([[0], [1]], device=device)
    name, training = type(model).__name__, model.training
    try:
        with torch.no_grad():
            out = model.eval()(x, edge_index)  # eval: no running statistics change
    except Exception as exc:
        raise ValueError(f"{name}.forward(x, edge_index) failed on a probe graph (2 nodes, "
                         f"1 edge, {in_channels} features): {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(training)
    if not isinstance(out, Tensor) or out.dim() != 2 or out.size(0) != 2:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"{name}.forward(x, edge_index) must return one row per node "
                         f"[num_nodes, dim], got {got} for 2 nodes")
    return int(out.size(1))


def _device_of(model: nn.Module) -> torch.device:
    ref = next(itertools.chain(model.parameters(), model.buffers()), None)
    return ref.device if ref is not None else torch.device("cpu")


def _drop_tensors(obj: object) -> None:
    for name, value in list(vars(obj).items()):
        if isinstance(value, Tensor):
            setattr(obj, name, None)


class ServedModel:
    """The model as served: forward on a sampled subgraph.

    Any ``torch.nn.Module`` whose ``forward(x, edge_index)`` returns one row per node is served.
    PyG's ``BasicGNN`` (GraphSAGE, GCN, GAT, GIN, ...) runs with its per-layer trimming
    (``num_sampled_nodes_per_hop``); any other module runs ``model(x, edge_index)`` on the whole
    sampled subgraph. Exact mode's subgraph holds every in-edge of every node within ``L - 1``
    hops of a seed, so the seed rows are exact for any ``L``-layer model whose outputs depend on
    in-edges only.

    GCN normalises by node degree. On a subgraph the boundary nodes have truncated degrees, so in
    exact mode a BasicGNN GCN's edge weights are PyG's full-graph ``gcn_norm`` weights
    (:class:`ExactGcnNorm`, built from the graph's in-degrees and per-node self-loop counts) and
    the convs' own normalisation is switched off for that call. Sampled mode keeps PyG's
    mini-batch behaviour (normalise on the subgraph). A normalising ``GCNConv`` inside any other
    module is not corrected (logged).

    ``self_loops`` (int64 [num_nodes], :meth:`GraphData.self_loop_count`) matters only for GCN
    with ``add_self_loops``; None means the graph has no self loops. ``capacity`` sizes the
    degrees for nodes appended while serving (docs/architecture.md, "The living graph"; default: the
    nodes given), and :meth:`update_degrees` keeps them current as edges change.

    ``in_channels`` (the graph's feature width) lets the output width of a module that is not a
    BasicGNN be found by :func:`probe_out_dim` at construction, which also checks its forward;
    without it ``model.in_channels`` is used, else ``model.out_channels``.
    """

    def __init__(self, model: nn.Module, in_degree: Tensor | None = None,
                 self_loops: Tensor | None = None, precision: str = "fp32",
                 fast: bool = True, capacity: int | None = None,
                 in_channels: int | None = None) -> None:
        from torch_geometric.nn.models.basic_gnn import BasicGNN

        self.model = model
        self.basic_gnn = isinstance(model, BasicGNN)
        #: whether the forward takes PyG's per-hop counts (trimming); else model(x, edge_index)
        self.trims = _accepts(model.forward, TRIM_ARG)
        self.released = False
        self.gcn_convs = self._gcn_convs(model)
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
        self._out_dim = self._find_out_dim(in_channels)
        self.precision = precision
        self.fast: FastGNN | None = None
        if fast and self.basic_gnn:
            self.fast = FastGNN.from_pyg(model, precision, self.gcn_norm, _device_of(model))
        elif fast:
            log.info("fast model path off, serving with the module's own forward: %s is not a "
                     "PyG BasicGNN", type(model).__name__)
        elif precision != "fp32":
            raise ValueError("inference.precision other than fp32 needs inference.fast_model")

    def _gcn_convs(self, model: nn.Module) -> list[Any]:
        """The GCN convs exact mode renormalises: those of a BasicGNN that normalise themselves
        (the rest sum over in-edges, which an exact-mode subgraph holds in full)."""
        from torch_geometric.nn import GCNConv

        gcn = [m for m in model.modules() if isinstance(m, GCNConv)]
        for conv in gcn:
            if conv.cached:
                # The cache holds the first request's subgraph; every later request has another.
                log.warning("GCN kwarg cached=True ignored: each request has its own subgraph")
                conv.cached = False
                conv._cached_edge_index = None
                conv._cached_adj_t = None
        normalising = [c for c in gcn if c.normalize]
        if normalising and not self.basic_gnn:
            log.warning("%s: its GCNConv normalises by subgraph degrees, so exact mode is not "
                        "exact for it (only PyG's GCN model gets full-graph degrees)",
                        type(model).__name__)
            return []
        return normalising

    def _find_out_dim(self, in_channels: int | None) -> int:
        out_channels = getattr(self.model, "out_channels", None)
        if self.basic_gnn:
            return int(out_channels)  # type: ignore[arg-type]
        width = in_channels if in_channels is not None else getattr(self.model, "in_channels",
                                                                    None)
        if isinstance(width, int) and not isinstance(width, bool) and width > 0:
            return probe_out_dim(self.model, width)
        if isinstance(out_channels, int) and not isinstance(out_channels, bool):
            return out_channels
        raise ValueError(f"{type(self.model).__name__}: its output width is unknown (no int "
                         "out_channels attribute): pass in_channels to probe it")

    @property
    def out_dim(self) -> int:
        """Width of the served rows."""
        return self._out_dim

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
        """The forward with the module's own layers (the reference the fast path is checked
        against): trimmed per layer for a BasicGNN, else ``model(x, edge_index)``."""
        if self.released:
            raise RuntimeError("this ServedModel was released")
        x = x.float()  # features stored in fp16/bf16: PyG's layers hold fp32 weights
        if exact and self.gcn_norm is not None:
            return self._gcn_exact(x, n_id, edge_index, num_nodes, num_edges)
        if self.trims:
            return self.model(x, edge_index, num_sampled_nodes_per_hop=num_nodes,
                              num_sampled_edges_per_hop=num_edges)
        return self.model(x, edge_index)

    def release(self) -> None:
        """Free every tensor this model holds on its device: the module's parameters and
        buffers go to the meta device (in place, so other holders of the module free theirs
        too), the fast layers and GCN degrees are dropped. The object is unusable afterwards
        (calls raise RuntimeError); CUDA graphs captured over it must be dropped first."""
        if self.released:
            return
        self.released = True
        if self.fast is not None:
            for layer in {id(x): x for x in [*self.fast.layers, *self.fast.exact_layers]}.values():
                _drop_tensors(layer)
            self.fast = None
        if self.gcn_norm is not None:
            _drop_tensors(self.gcn_norm)
            self.gcn_norm = None
        self.gcn_convs = []
        try:
            self.model.to("meta")
        except (RuntimeError, NotImplementedError) as exc:
            log.warning("%s: its tensors could not be moved off the device on release: %s",
                        type(self.model).__name__, exc)

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
