"""Compiled bytecode kept in the cache folder (decision 0067): where the interpreter keeps none
beside the sources, the daemon's processes read it from ``$QUIVER_SERVE_CACHE/pycache``, and when
writing bytecode is off a low-priority child compiles what each process imported, so the next
start imports without compiling."""

from __future__ import annotations

import importlib
import importlib.util
import marshal
import os
import sys
import time
from pathlib import Path

import pytest

from quiver_serve.engine.procs import bytecode


@pytest.fixture
def fake_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "src" / "qs_fake_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 41 + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for name in ("PYTHONPYCACHEPREFIX", bytecode.COMPILE_ENV):  # recorded: undone after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(bytecode, "_handed", set())
    monkeypatch.delitem(sys.modules, "qs_fake_pkg", raising=False)
    return "qs_fake_pkg"


def test_read_only_sources_without_bytecode_get_a_prefix_children_inherit(
        fake_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False)  # a read-only mount
    folder = tmp_path / "cache" / "pycache"
    assert bytecode.keep_bytecode(fake_module, folder) == str(folder)
    assert folder.is_dir() and os.environ["PYTHONPYCACHEPREFIX"] == str(folder)
    assert sys.pycache_prefix == str(folder)  # this process reads it too
    assert bytecode.COMPILE_ENV not in os.environ  # the interpreter writes it there itself
    assert bytecode.compile_later("test") is None


def test_writing_turned_off_compiles_what_was_imported_for_the_next_start(
        fake_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE=1
    folder = tmp_path / "cache" / "pycache"
    assert bytecode.keep_bytecode(fake_module, folder) == str(folder)
    assert os.environ[bytecode.COMPILE_ENV] == "1"
    mod = importlib.import_module(fake_module)
    cached = Path(importlib.util.cache_from_source(mod.__file__))
    assert str(cached).startswith(str(folder)) and not cached.exists()  # nothing written
    thread = bytecode.compile_later("test")
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    data = cached.read_bytes()  # a timestamp pyc of this very source: what the next start reads
    assert int.from_bytes(data[8:12], "little") == int(os.stat(mod.__file__).st_mtime)
    space: dict = {}
    exec(marshal.loads(data[16:]), space)
    assert space["VALUE"] == 42
    assert bytecode.hand_over(str(folder)) is None  # each source is handed once
    assert not list(folder.glob("compile-*.txt"))  # the child removed its list


def test_nothing_changes_where_bytecode_is_or_can_be_written(
        fake_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cache" / "pycache"
    assert bytecode.keep_bytecode(fake_module, folder) is None  # writable: Python keeps it there
    importlib.import_module(fake_module)  # writes its .pyc
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.keep_bytecode(fake_module, folder) is None  # the bytecode is there
    assert "PYTHONPYCACHEPREFIX" not in os.environ and not folder.exists()
    assert bytecode.compile_later("test") is None  # not turned on
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "theirs"))
    assert bytecode.keep_bytecode(fake_module, folder) is None  # the operator's prefix stays


def test_the_compiling_child_stops_at_its_deadline(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    monkeypatch.setattr(bytecode.os, "nice", lambda inc: 0)
    src = tmp_path / "m.py"
    src.write_text("X = 1\n")
    listing = tmp_path / "list.txt"
    listing.write_text(str(src))
    t0 = time.monotonic()
    assert bytecode.compile_listed(listing, timeout_s=-1.0) == 0
    assert time.monotonic() - t0 < 5 and not listing.exists()
    assert not Path(importlib.util.cache_from_source(str(src))).exists()
    listing.write_text(f"{src}\n{tmp_path / 'gone.py'}")
    assert bytecode.compile_listed(listing, timeout_s=60.0) == 1  # the missing one counted
    assert Path(importlib.util.cache_from_source(str(src))).exists()
