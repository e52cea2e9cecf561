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


def _edge_record(version: int):
    from quiver_serve.graph.records import EdgeRecord

    return EdgeRecord(version, 1000.0 + version, np.array([[1, 2]]), np.zeros((0, 2), np.int64))


def test_a_later_base_links_unchanged_pieces_and_writes_changed_ones(tmp_path: Path) -> None:
    from quiver_serve.graph.update_log import UpdateLog, load_base

    x = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    with UpdateLog(tmp_path / "log") as ulog:
        ulog.write_base(0, {"indptr": np.arange(51, dtype=np.int64), "x": x}, {"name": "g"})
        ulog.append(_edge_record(1))
        ulog.write_base(1, {"indptr": np.arange(1, 52, dtype=np.int64), "x": x.copy()},
                        {"name": "g"})
        version, arrays, _ = load_base(tmp_path / "log")
    assert version == 1 and not (tmp_path / "log" / "base-00000000000000000000").exists()
    folder = tmp_path / "log" / "base-00000000000000000001"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["arrays"]["x"].get("linked") is True  # same bytes: linked, not written again
    assert "linked" not in meta["arrays"]["indptr"]  # changed: written
    assert (folder / "x.npy").stat().st_nlink == 1  # the old base's name went with it (GC)
    assert np.array_equal(arrays["x"], x) and np.array_equal(arrays["indptr"], np.arange(1, 52))


def test_a_damaged_or_mismatched_piece_is_refused_by_name(tmp_path: Path) -> None:
    from quiver_serve.graph.update_log import UpdateLogError, load_base

    _npz(tmp_path / "g.npz", 0)
    living.load_serving_graph(_cfg(tmp_path))
    folder = tmp_path / "log" / "base-00000000000000000000"
    piece = folder / "x.npy"
    data = piece.read_bytes()
    piece.write_bytes(data[:len(data) // 2])  # cut short (a disk that lost its tail)
    with pytest.raises(UpdateLogError, match=r"x\.npy cannot be mapped"):
        load_base(tmp_path / "log")
    piece.write_bytes(data)
    np.save(folder / "indices.npy", np.zeros(7, np.int32))  # another array under its name
    with pytest.raises(UpdateLogError, match=r"indices\.npy is int32\[7\], meta\.json says"):
        load_base(tmp_path / "log")


def test_a_synthetic_graph_is_generated_once(tmp_path: Path, monkeypatch) -> None:
    from quiver_serve.graph import synthetic

    calls = []
    real = synthetic.generate_synthetic
    monkeypatch.setattr(synthetic, "generate_synthetic",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = GraphConfig(format="synthetic", name="syn", synthetic_preset="papers100m",
                      synthetic_scale=1e-4, update_log_dir=str(tmp_path / "log"))
    first, _ = living.load_serving_graph(cfg)
    again, _ = living.load_serving_graph(cfg)
    assert calls == [1]
    assert torch.equal(first.indices, again.indices) and torch.equal(first.x, again.x)


def test_without_hard_links_an_unchanged_piece_is_written_again(tmp_path: Path,
                                                                monkeypatch) -> None:
    from quiver_serve.graph import base_files
    from quiver_serve.graph.update_log import UpdateLog, load_base

    def no_links(_src: object, _dst: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(base_files.os, "link", no_links)
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    with UpdateLog(tmp_path / "log") as ulog:
        ulog.write_base(0, {"x": x}, {"name": "g"})
        ulog.append(_edge_record(1))
        ulog.write_base(1, {"x": x}, {"name": "g"})
        version, arrays, _ = load_base(tmp_path / "log")
    meta = json.loads((tmp_path / "log" / "base-00000000000000000001" / "meta.json").read_text())
    assert version == 1 and "linked" not in meta["arrays"]["x"]
    assert np.array_equal(arrays["x"], x)


def test_settings_that_do_not_shape_the_graph_keep_its_snapshot(tmp_path: Path) -> None:
    from quiver_serve.graph.snapshot import source_stamp

    _npz(tmp_path / "g.npz", 0)
    stamp = source_stamp(_cfg(tmp_path))
    assert source_stamp(_cfg(tmp_path).model_copy(update={"name": "renamed"})) == stamp
    assert source_stamp(_cfg(tmp_path).model_copy(update={"synthetic_scale": 0.5})) == stamp
    syn = GraphConfig(format="synthetic", synthetic_preset="papers100m", synthetic_scale=1e-4)
    assert source_stamp(syn) != source_stamp(syn.model_copy(update={"synthetic_seed": 1}))


class Bar:
    def update(self, n: int) -> None:
        pass


def test_a_large_array_is_synced_as_it_is_written(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A base or table file is synced every ``SYNC_EVERY_BYTES`` while it is written, so its
    dirty pages never pile up behind a concurrent fsync of the update log (decision 0057); the
    file reads back whole, with the digest of its data."""
    from quiver_serve.graph import base_files

    monkeypatch.setattr(base_files, "SYNC_EVERY_BYTES", 1 << 12)
    monkeypatch.setattr(base_files, "WRITE_CHUNK_BYTES", 3 << 12)
    synced_at: list[int] = []
    real = base_files.os.fdatasync
    monkeypatch.setattr(base_files.os, "fdatasync",
                        lambda fd: (synced_at.append(base_files.os.fstat(fd).st_size), real(fd)))
    arr = np.arange(10_000, dtype=np.int64)  # 80,000 bytes: 20 pieces
    with open(tmp_path / "a.npy", "wb") as f:
        digest = base_files.write_array(f, arr, Bar())
    assert len(synced_at) == 20 and synced_at == sorted(synced_at)
    assert np.diff(synced_at).max() <= 1 << 12
    assert np.array_equal(np.load(tmp_path / "a.npy"), arr)
    assert digest == hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()
