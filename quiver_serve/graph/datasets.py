"""Dataset loaders: Planetoid raw folders, .npz, saved PyG ``Data``, synthetic power-law graphs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from quiver_serve.config import GraphConfig, resolve_path
from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)


def load_graph(cfg: GraphConfig) -> GraphData:
    """Load the graph a config names, logging what was loaded and how long it took."""
    t0 = time.perf_counter()
    log.info("loading graph: format=%s path=%s", cfg.format, cfg.path)
    if cfg.format == "synthetic":
        from quiver_serve.graph.synthetic import generate_synthetic

        graph = generate_synthetic(cfg)
    else:
        if cfg.path is None:
            raise ValueError(f"graph.path is required for format {cfg.format!r}")
        path = resolve_path(cfg.path)
        if not path.exists():
            raise FileNotFoundError(f"graph.path {path} does not exist")
        loader = {"planetoid": load_planetoid_raw, "npz": load_npz, "pyg": load_pyg_data}[cfg.format]
        graph = loader(path, cfg.name)
    log.info("loaded %s in %.2f s", graph.describe(), time.perf_counter() - t0)
    return graph


def load_planetoid_raw(raw_dir: Path, name: str) -> GraphData:
    """Read a Planetoid ``raw/`` folder (``ind.<name>.*``) exactly as PyG's ``Planetoid`` does."""
    from torch_geometric.io import read_planetoid_data

    prefix = name.lower()
    missing = [s for s in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
               if not (raw_dir / f"ind.{prefix}.{s}").exists()]
    if missing:
        raise FileNotFoundError(f"{raw_dir} lacks Planetoid files for {name!r}: {missing}")
    data = read_planetoid_data(str(raw_dir), prefix)
    return GraphData.from_edge_index(data.edge_index, data.x, name=prefix, y=data.y)
