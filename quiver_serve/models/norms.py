"""Which norms between a GNN's layers treat nodes one by one (docs/architecture.md, "Typed
graphs"; decision 0062).

A norm over all nodes of a graph (PyG's ``LayerNorm`` in graph mode, ``GraphNorm``,
``InstanceNorm``, ``PairNorm``, ``MeanSubtractionNorm``, ``GraphSizeNorm``) makes every node's
row depend on the whole graph given to the forward: no subgraph answer is exact, and a layer
cannot compute only some of its rows. ``graph_wide_norm`` names such a norm (exact requests
are refused for it); ``rowwise_norms`` says whether every norm is one known to treat rows one
by one in eval mode (what trimming rows needs).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

#: PyG norms whose output rows depend on other nodes of the graph
GRAPH_WIDE = ("GraphNorm", "InstanceNorm", "PairNorm", "MeanSubtractionNorm", "GraphSizeNorm")


def _norms(model: nn.Module) -> Iterator[nn.Module]:
    for layer in getattr(model, "norms", None) or []:
        yield from (layer.values() if isinstance(layer, nn.ModuleDict) else [layer])


def graph_wide_norm(model: nn.Module) -> str | None:
    """The class of a norm between the model's layers that reads all nodes of a graph, or
    None."""
    from torch_geometric.nn.norm import LayerNorm

    for m in _norms(model):
        if type(m).__name__ in GRAPH_WIDE or (isinstance(m, LayerNorm) and m.mode != "node"):
            return f"{type(m).__name__}" + (f"(mode={m.mode!r})" if isinstance(m, LayerNorm)
                                            else "")
    return None


def rowwise_norms(model: nn.Module) -> bool:
    """Whether every norm between the layers treats rows one by one in eval mode (none,
    identity, batch norm, layer norm per node)."""
    from torch_geometric.nn.norm import BatchNorm, LayerNorm

    def rowwise(m: nn.Module) -> bool:
        return isinstance(m, (nn.Identity, nn.BatchNorm1d, BatchNorm, nn.LayerNorm)) or \
            (isinstance(m, LayerNorm) and m.mode == "node")

    return all(rowwise(m) for m in _norms(model))


def exact_refusal(label: str, model: nn.Module) -> str | None:
    """Why a model's exact answers cannot be given (a graph-wide norm), or None."""
    norm = graph_wide_norm(model)
    if norm is None:
        return None
    return (f"{label} normalises over all nodes of a graph between layers ({norm}): a node's "
            "row depends on the whole graph, not on its neighbourhood, so exact answers are "
            "not served; ask sampled ones, or use a norm per node")
