"""The shipped typed example (configs/cora_typed.yaml): Cora as papers and words, served by the
to_hetero GraphSAGE that models/train_cora_typed.py trained; its weights are trained (they
classify), and its exact answers are PyG's full-graph forward."""

from __future__ import annotations

from pathlib import Path

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.models.typed_served import build_typed_model
from quiver_serve.sampling.typed import TypedReferenceSampler

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "cora_typed.yaml"


def test_typed_cora_is_served_exactly_and_its_weights_are_trained() -> None:
    from torch_geometric.io import read_planetoid_data

    cfg = ServeConfig.from_yaml(CONFIG)
    graph = load_typed_graph(cfg.graph)
    assert graph.num_nodes == {"paper": 2708, "word": 1433}
    assert set(graph.edge_types) == {("paper", "cites", "paper"), ("paper", "has_word", "word"),
                                     ("word", "rev_has_word", "paper")}
    served = build_typed_model(ModelSpec.from_config(cfg.model), graph)
    x = served.inputs({t: torch.arange(n) for t, n in graph.num_nodes.items()})
    with torch.no_grad():
        full = served.model(x, graph.edge_index_dict())
    rows = TypedLayerwise(served).run(chunk_nodes=1000)
    torch.testing.assert_close(rows["paper"], full["paper"], rtol=0, atol=1e-5)
    ids = torch.tensor([0, 1, 2707, 1])
    out = TypedReferenceSampler(graph).sample("paper", ids, [-1, -1], seed=0)
    torch.testing.assert_close(served(out), full["paper"][ids], rtol=0, atol=1e-5)
    # the head trained with the weights classifies the public test split
    head = torch.nn.Linear(64, 7)
    weights = Path(str(cfg.model.weights))
    head_file = weights.with_name(weights.stem + "_head.pt")
    head.load_state_dict(torch.load(head_file, weights_only=True))
    split = read_planetoid_data(str(cfg.graph.path), "cora")
    with torch.no_grad():
        pred = head(full["paper"]).argmax(1)
    accuracy = float((pred[split.test_mask] == split.y[split.test_mask]).float().mean())
    assert accuracy > 0.72, accuracy
