"""Train the typed example: to_hetero(GraphSAGE) on Cora as papers and words (public Planetoid
split), CPU, under a minute.

    python models/train_cora_typed.py   # writes quiver_serve/defaults/cora_typed_sage.pt, _head.pt

The graph and the model are what ``configs/cora_typed.yaml`` serves, built by the same code
(``load_typed_graph``, ``build_typed_model`` with random weights): papers with their raw
bag-of-words features, words with one constant column, paper-cites-paper, paper-has_word-word and
word-rev_has_word-paper. The paper rows of the model's output are the served 64-d embedding; a
``Linear(64, 7)`` head on top is trained jointly for the 7 Cora classes. The checkpoint kept is
the epoch with the best validation accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere, without installing the package

from quiver_serve.config import ServeConfig  # noqa: E402
from quiver_serve.graph.typed_load import load_typed_graph  # noqa: E402
from quiver_serve.models.spec import ModelSpec  # noqa: E402
from quiver_serve.models.typed_served import TypedServedModel, build_typed_model  # noqa: E402

CONFIG_PATH = REPO_ROOT / "configs" / "cora_typed.yaml"
NUM_CLASSES = 7


def load(config: Path) -> tuple[TypedServedModel, dict[str, Tensor]]:
    """The served model with random weights (seed of the config), and the split's masks."""
    from torch_geometric.io import read_planetoid_data

    cfg = ServeConfig.from_yaml(config)
    graph = load_typed_graph(cfg.graph)
    spec = dataclasses.replace(ModelSpec.from_config(cfg.model), weights=None)
    served = build_typed_model(spec, graph)
    split = read_planetoid_data(str(cfg.graph.path), "cora")
    assert torch.equal(split.x, graph.x["paper"]), "Planetoid reader and served graph disagree"
    return served, {"y": graph.y["paper"], "train": split.train_mask, "val": split.val_mask,
                    "test": split.test_mask}


def forward(served: TypedServedModel, x: dict[str, Tensor],
            edge_index: dict[tuple[str, str, str], Tensor]) -> Tensor:
    return served.model(x, edge_index)["paper"]


def train(served: TypedServedModel, data: dict[str, Tensor], epochs: int, lr: float,
          weight_decay: float, dropout: float) -> tuple[dict, dict, dict[str, float], int]:
    """Adam full-batch training; the best-validation state_dicts, their accuracies, epoch."""
    graph = served.graph
    x = served.inputs({t: torch.arange(n) for t, n in graph.num_nodes.items()})
    edge_index = graph.edge_index_dict()
    model = served.model
    head = torch.nn.Linear(served.out_dims["paper"], NUM_CLASSES)
    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=lr,
                                 weight_decay=weight_decay)
    best = (-1.0, float("inf"))
    kept: tuple[dict, dict, dict[str, float], int] = ({}, {}, {}, -1)
    for epoch in range(1, epochs + 1):
        model.train()
        head.train()
        optimizer.zero_grad()
        x_drop = {t: F.dropout(v, p=dropout, training=True) if t == "paper" else v
                  for t, v in x.items()}
        emb = F.dropout(forward(served, x_drop, edge_index), p=dropout, training=True)
        loss = F.cross_entropy(head(emb)[data["train"]], data["y"][data["train"]])
        loss.backward()
        optimizer.step()
        model.eval()
        head.eval()
        with torch.no_grad():
            pred = head(forward(served, x, edge_index)).argmax(1)
        acc = {s: float((pred[data[s]] == data["y"][data[s]]).float().mean())
               for s in ("train", "val", "test")}
        if (acc["val"], -loss.item()) > (best[0], -best[1]):
            best = (acc["val"], loss.item())
            kept = (_copy(model.state_dict()), _copy(head.state_dict()), acc, epoch)
        if epoch % 20 == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.4f} train {acc['train']:.3f} "
                  f"val {acc['val']:.3f} test {acc['test']:.3f}")
    return kept


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG_PATH)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--dropout", type=float, default=0.8, help="on paper features and "
                        "embeddings")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: same float summation order, same result on every run
    t0 = time.perf_counter()
    cfg = ServeConfig.from_yaml(args.config)
    served, data = load(args.config)
    print(served.graph.describe())
    model_state, head_state, acc, epoch = train(served, data, args.epochs, args.lr,
                                                args.weight_decay, args.dropout)
    trunk_path = Path(str(cfg.model.weights))
    head_path = trunk_path.with_name(trunk_path.stem + "_head.pt")
    torch.save(model_state, trunk_path)
    torch.save(head_state, head_path)
    print(f"best epoch {epoch}: train {acc['train']:.3f} val {acc['val']:.3f} "
          f"test {acc['test']:.3f} ({time.perf_counter() - t0:.1f} s)")
    print(f"saved {trunk_path.name} ({trunk_path.stat().st_size:,} B) and {head_path.name} "
          f"({head_path.stat().st_size:,} B)")


if __name__ == "__main__":
    main()
