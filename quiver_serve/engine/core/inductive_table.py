"""Exact rows of an inductive request's new nodes from the exact table (docs/architecture.md,
"The living graph"; decision 0064).

A request's own new nodes have in-edges and no out-edges, so embedding them changes no row of an
existing node: layer ``l`` of a new node reads layer ``l - 1`` of itself and of its in-neighbours,
and the in-neighbours' rows are the table's. When the table serves the request's model, is ready,
no in-neighbour's row of a layer the new nodes read is pending and no asked id's row is stale,
the new nodes' rows are ``L`` layer applications over their own in-lists: work in their in-edges,
where the on-the-fly path samples the whole ``L``-hop neighbourhood of every in-neighbour. Else
(or for a degree-weighted model, whose norm reads degrees by id) the caller takes that path.
"""

from __future__ import annotations

import numpy as np
import torch

from quiver_serve.engine.core.exact_table import ExactTable


def inductive_rows(table: ExactTable, ids: np.ndarray, features: np.ndarray,
                   offsets: np.ndarray, neighbors: np.ndarray, first_new: int,
                   feature_dtype: torch.dtype) -> np.ndarray | None:
    """float32 rows of ``ids`` (from the table) then of the new nodes (ids ``first_new, ...``:
    ``features`` float32 [m, F], in-neighbours ``neighbors[offsets[i]:offsets[i + 1]]``), or
    None when the table cannot answer them exactly (module docstring). ``feature_dtype``: the
    feature store's, which the on-the-fly path stores the new rows in (the same rounding)."""
    model = table.model
    if model.degree_weighted:
        return None
    table.settle_marks()
    if not table.ready or (ids.size and bool(table.stale[ids].any())):
        return None
    dev, num_layers = table.device, len(table.layers)
    src = np.unique(neighbors)
    src_t = torch.from_numpy(src).to(dev)
    if src.size and any(bool(table.pending[layer][src_t].any())
                        for layer in range(num_layers - 1)):
        return None
    m = int(features.shape[0])
    counts = torch.from_numpy(np.diff(offsets).astype(np.int64))
    col = torch.from_numpy(m + np.searchsorted(src, neighbors).astype(np.int64))
    dst = torch.repeat_interleave(torch.arange(m), counts, output_size=int(col.numel()))
    edge_index = torch.stack([col, dst]).to(dev)
    n_id = torch.cat([torch.arange(first_new, first_new + m, device=dev), src_t])
    h = torch.from_numpy(features).to(feature_dtype).to(dev, torch.float32)
    with torch.no_grad():
        for layer in range(num_layers):
            x = torch.cat([h, table.layer_input(layer, src_t)])
            h = model.forward_layer(layer, x, edge_index, m, n_id)
    new_rows = h.float().cpu().numpy()
    if not ids.size:
        return new_rows
    return np.concatenate([table.lookup(ids), new_rows])
