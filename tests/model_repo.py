"""A model repository for tests (docs/architecture.md, "Models and versions"): Cora's GraphSAGE as
version 1 (the shipped weights), version 2 (the same weights scaled, so its answers differ) and, on
request, a GAT model."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from quiver_serve.config import DEFAULTS_DIR

SAGE_KWARGS = {"hidden_channels": 128, "num_layers": 2, "out_channels": 64}
GAT_KWARGS = {"hidden_channels": 16, "num_layers": 2, "out_channels": 32, "heads": 2}


def write_model(root: Path, name: str, config: dict, versions: dict[int, dict]) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    for version, state in versions.items():
        (folder / str(version)).mkdir(exist_ok=True)
        torch.save(state, folder / str(version) / "model.pt")
    return folder


def sage_state(scale: float = 1.0) -> dict:
    state = torch.load(DEFAULTS_DIR / "cora_graphsage.pt", weights_only=True)
    return {k: v * scale if v.is_floating_point() else v for k, v in state.items()}


def cora_repository(root: Path, policy: dict | None = None, traffic: dict | None = None) -> Path:
    """``sage`` with versions 1 and 2 (served per ``policy``, default both)."""
    config: dict = {"class": "GraphSAGE", "kwargs": dict(SAGE_KWARGS),
                    "version_policy": policy or {"all": True}}
    if traffic is not None:
        config["traffic"] = traffic
    write_model(root, "sage", config, {1: sage_state(), 2: sage_state(1.5)})
    return root


def add_gat(root: Path, in_channels: int = 1433, seed: int = 0) -> torch.nn.Module:
    """``gat``, version 1, random weights (returned, to compare with)."""
    from torch_geometric.nn import models as pyg_models

    torch.manual_seed(seed)
    model = pyg_models.GAT(in_channels=in_channels, **GAT_KWARGS).eval()
    write_model(root, "gat", {"class": "GAT", "kwargs": dict(GAT_KWARGS)},
                {1: model.state_dict()})
    return model
