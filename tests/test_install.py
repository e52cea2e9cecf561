"""``pip install .`` (not editable) gives a working ``quiver-serve`` command.

The wheel is built from a copy of the files a source distribution holds (pyproject.toml, README.md,
quiver_serve/), never inside the checkout, and installed without dependencies into a venv of its
own. That venv reaches this environment's site-packages through a plain path line in a ``.pth``
file (so nothing is downloaded and torch is not reinstalled; the checkout's editable hook there is
not run), and every command runs from a folder that holds no checkout. What the installed package
must then find by itself: the embedded default (config, Cora, weights: package data), the C++
sampler's sources, and the console script that serves ``/v1/embed`` on Cora.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from loadtest.harness import Daemon

REPO_ROOT = Path(__file__).resolve().parents[1]
#: what the wheel is built from: the project's metadata and the package (package data included)
SDIST_FILES = ("pyproject.toml", "README.md", "quiver_serve")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run(argv: list[str], cwd: Path, timeout_s: float = 300.0) -> str:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, f"{' '.join(argv)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv the wheel is installed in, a working directory outside every checkout)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SDIST_FILES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(path, src / name)
    # --no-build-isolation: setuptools from this environment, nothing fetched
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "wheels"), str(src)], cwd=tmp)
    (wheel,) = (tmp / "wheels").glob("quiver_serve-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
          "--no-deps", "--no-index", str(wheel)], cwd=tmp)
    site = Path(_run([str(venv / "bin" / "python"), "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shutil.rmtree(src)  # the installed copy must not lean on the sources it was built from
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere


def test_the_installed_package_finds_its_data_by_itself(installed: tuple[Path, Path]) -> None:
    venv, elsewhere = installed
    probe = (
        "import json, quiver_serve\n"
        "from quiver_serve.config import DEFAULT_CONFIG_PATH, ServeConfig\n"
        "from quiver_serve.sampling.cpu import SOURCE_PATH\n"
        "cfg = ServeConfig.default()\n"
        "print(json.dumps({'package': quiver_serve.__file__, 'config': str(DEFAULT_CONFIG_PATH),\n"
        "  'graph': cfg.graph.path, 'weights': cfg.model.weights, 'cpp': str(SOURCE_PATH)}))\n")
    found = json.loads(_run([str(venv / "bin" / "python"), "-c", probe], cwd=elsewhere))
    for what, path in found.items():
        assert Path(path).is_relative_to(venv), f"{what} from outside the install: {path}"
        assert Path(path).exists(), f"{what}: {path} is not installed"
    raw = Path(found["graph"])
    assert sorted(p.name for p in raw.iterdir()) == sorted(
        f"ind.cora.{s}" for s in ("allx", "ally", "graph", "test.index", "tx", "ty", "x", "y"))
    assert (raw.parents[1] / "LICENSE.kimiyoung-planetoid").exists()  # the data's licence with it


def test_quiver_serve_command_serves_cora_from_another_folder(
        installed: tuple[Path, Path]) -> None:
    venv, elsewhere = installed
    # the C++ sampler's build (minutes on a small box) is left out: its sources are checked above
    daemon = Daemon(python=str(venv / "bin" / "quiver-serve"), command=(), cwd=elsewhere,
                    log_path=elsewhere.parent / "daemon.log", ready_timeout_s=240.0,
                    env={"PYTHONPATH": None, "QUIVER_SERVE_DISABLE_CPP": "1"},
                    overrides={"server.http_workers": 1})
    try:
        daemon.wait_ready()
        r = httpx.post(daemon.url + "/v1/embed", json={"node_ids": [0, 1, 2707]}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "cora-graphsage" and body["dim"] == 64
        assert len(body["embeddings"]) == 3 and all(len(row) == 64 for row in body["embeddings"])
        meta = httpx.get(daemon.url + "/v2/models/cora-graphsage", timeout=30).json()
        assert meta["parameters"]["state_dict"] == "quiver_serve/defaults/cora_graphsage.pt"
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=60) == 0, daemon.log()
    finally:
        daemon.stop()
