"""A start is a map (quiver_serve/graph/snapshot.py): the first start writes the loaded graph as
the base of version 0 with content hashes; a later start maps it without loading or generating
the dataset; a dataset file that changed under its log is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph import datasets, living
from quiver_serve.graph.csc import GraphData


def _npz(path: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, 300, (2, 2000), generator=g)
    np.savez(path, edge_index=ei.numpy(), x=torch.randn(300, 5, generator=g).numpy())


def _cfg(tmp: Path, **kw: object) -> GraphConfig:
    return GraphConfig(format="npz", path=str(tmp / "g.npz"), name="g",
                       update_log_dir=str(tmp / "log"), **kw)


def test_the_first_start_writes_a_snapshot_and_the_next_maps_it(tmp_path: Path,
                                                                 monkeypatch) -> None:
    _npz(tmp_path / "g.npz", 0)
    cfg = _cfg(tmp_path)
    first, version = living.load_serving_graph(cfg)
    assert version == 0
    meta = json.loads((tmp_path / "log" / "base-00000000000000000000" / "meta.json").read_text())
    for name, spec in meta["arrays"].items():  # every piece named by its content hash
        data = np.load(tmp_path / "log" / "base-00000000000000000000" / f"{name}.npy")
        assert spec["blake2b"] == hashlib.blake2b(np.ascontiguousarray(data).tobytes(),
                                                  digest_size=16).hexdigest()

    def no_load(_cfg: GraphConfig) -> GraphData:
        raise AssertionError("the dataset was loaded again instead of mapped")

    monkeypatch.setattr(datasets, "load_graph", no_load)
    again, version = living.load_serving_graph(cfg)
    assert version == 0
    for a, b in ((first.indptr, again.indptr), (first.indices, again.indices),
                 (first.x, again.x)):
        assert torch.equal(a, b)


def test_a_dataset_changed_under_its_log_is_refused(tmp_path: Path) -> None:
    _npz(tmp_path / "g.npz", 0)
    living.load_serving_graph(_cfg(tmp_path))
    _npz(tmp_path / "g.npz", 1)  # another graph at the same path
    with pytest.raises(errors.ServeError, match="changed since the update log"):
        living.load_serving_graph(_cfg(tmp_path))


def test_no_snapshot_when_switched_off(tmp_path: Path) -> None:
    _npz(tmp_path / "g.npz", 0)
    living.load_serving_graph(_cfg(tmp_path, snapshot=False))
    assert not list((tmp_path).glob("log/base-*"))
