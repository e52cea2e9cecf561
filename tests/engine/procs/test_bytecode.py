"""``process.keep_bytecode``: children keep compiled bytecode in the cache folder when they
cannot keep it beside read-only sources (each start would compile torch and PyG again)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from quiver_serve.engine.procs import process


@pytest.fixture
def fake_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "src" / "qs_fake_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")  # recorded: the test's own value is undone
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    return "qs_fake_pkg"


def test_read_only_sources_without_bytecode_get_a_prefix_children_inherit(
        fake_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process.os, "access", lambda path, mode: False)  # a read-only mount
    folder = tmp_path / "cache" / "pycache"
    assert process.keep_bytecode(fake_module, folder) == str(folder)
    assert folder.is_dir() and os.environ["PYTHONPYCACHEPREFIX"] == str(folder)


def test_nothing_changes_where_bytecode_is_or_can_be_written(
        fake_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cache" / "pycache"
    assert process.keep_bytecode(fake_module, folder) is None  # writable: Python keeps it there
    import importlib

    importlib.import_module(fake_module)  # writes its .pyc
    monkeypatch.setattr(process.os, "access", lambda path, mode: False)
    assert process.keep_bytecode(fake_module, folder) is None  # the bytecode is there
    assert "PYTHONPYCACHEPREFIX" not in os.environ and not folder.exists()
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "theirs"))
    assert process.keep_bytecode(fake_module, folder) is None  # the operator's prefix stays
