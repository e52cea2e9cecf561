"""No tracked file names a folder of one machine (a home, a work tree, a temporary folder).

Such paths break on every other machine and tell readers about the one they came from. System
paths that are the same everywhere (``/dev/shm``, ``/usr/bin/env``, ``/proc``) are fine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Built from parts so this file does not match itself. The look-behind skips relative paths
# ("build/tmp") and URLs ("host/tmp/x"): only a path that starts at a root matches.
_SEP = "/"
_ROOTS = [
    _SEP + "home" + _SEP + r"[\w.-]+",
    _SEP + "root" + r"(?:" + _SEP + r"|\b)",
    _SEP + "work" + _SEP,
    _SEP + "tmp" + r"\b",
    _SEP + "var" + _SEP + "tmp" + r"\b",
    _SEP + "var" + _SEP + "folders" + r"\b",
    _SEP + "Users" + _SEP,
]
MACHINE_PATH = re.compile(
    r"(?<![\w.~/])(?:" + "|".join(_ROOTS) + r")|\b[A-Za-z]:\\{1,2}Users\\", re.IGNORECASE
)


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                         check=True).stdout
    return [REPO_ROOT / name for name in out.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file as text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def machine_paths(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in MACHINE_PATH.finditer(text)]


def test_no_tracked_file_names_a_machine_folder() -> None:
    found = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the work tree but not yet from the index
            continue
        text = text_of(path)
        if text is None:
            continue
        for line, match in machine_paths(text):
            found.append(f"{path.relative_to(REPO_ROOT)}:{line}: {match}")
    assert not found, "machine-specific paths in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "see " + _SEP + "home" + _SEP + "alice/data",
    "json: '" + _SEP + "tmp" + _SEP + "bench.json'",
    "LOG=${OUT:-" + _SEP + "tmp}",
    "PYTHONPATH=" + _SEP + "work" + _SEP + "main python",
    "cd " + _SEP + "root" + _SEP + "x",
    _SEP + "Users" + _SEP + "bob" + _SEP + "graph.npz",
    _SEP + "var" + _SEP + "folders" + _SEP + "xy" + _SEP + "T",
    "C:" + "\\" + "Users" + "\\" + "bob",
])
def test_pattern_catches_machine_paths(text: str) -> None:
    assert machine_paths(text)


@pytest.mark.parametrize("text", [
    "size /dev/shm", "#!/usr/bin/env bash", "/proc/self/smaps_rollup", "build/tmp/x",
    "https://example.com/tmp/x", "ROOT/Cora/raw", "../shared/data", "REPO_ROOT / 'tmp'",
])
def test_pattern_allows_portable_paths(text: str) -> None:
    assert not machine_paths(text)
