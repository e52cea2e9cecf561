"""Every command and code block the docs tell a user to run is run here, as written.

Per page (README.md, deploy/, bench/, loadtest/ READMEs, docs/*.md) the blocks run in order, in a
scratch folder that mirrors the repository (files a command writes land there). What changes:
the port (a free one, through the documented ``QUIVER_SERVE__SERVER__PORT`` and by rewriting
``localhost:8000`` / ``--port N`` in the text) and durations (the documented flags ``--seconds``,
``--duration-s``, ``--minutes`` get short values). ``curl`` fails on an HTTP error. A ``daemon``
block is started in its own process group and must answer ``/v2/health/ready`` before the next
block runs; it is stopped at the end of the page. ``check`` blocks (GPU benches, docker, kubectl)
are not run: bash parses them, every ``python`` command's flags exist in its ``--help``, every
``make`` target exists, every repository path they name exists; ``yaml`` blocks parse.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import (
    REPO_ROOT,
    RUN_LANGS,
    SHOW_LANGS,
    Block,
    commands,
    doc_files,
    read_blocks,
    unfenced_commands,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHORT = {"--seconds": "1", "--duration-s": "2", "--minutes": "0.05"}
DAEMON_READY_S = float(os.environ.get("DOC_TEST_READY_S", "240"))
BLOCK_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def localize(text: str, port: int) -> str:
    """The documented port becomes the test's; documented durations become short."""
    text = re.sub(r"(localhost|127\.0\.0\.1):80\d\d\b", rf"\1:{port}", text)
    text = re.sub(r"--port[ =]\d+", f"--port {port}", text)
    for flag, value in SHORT.items():
        text = re.sub(rf"{flag}[ =][\d.]+", f"{flag} {value}", text)
    return text


class Page:
    """One page's run: its scratch folder, environment and daemon."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.port = free_port()
        self.daemon: subprocess.Popen | None = None
        self.daemon_log = scratch / "daemon.log"
        for entry in REPO_ROOT.iterdir():
            if entry.name not in (".git", "__pycache__"):
                (scratch / entry.name).symlink_to(entry)
        shim = scratch / ".doc-bin"
        shim.mkdir()
        curl = shutil.which("curl")
        assert curl, "the docs' commands use curl: install it (apt-get install curl)"
        (shim / "curl").write_text(f'#!/bin/sh\nexec {curl} --fail-with-body "$@"\n')
        (shim / "curl").chmod(0o755)
        path = os.pathsep.join([str(shim), str(Path(sys.executable).parent),
                                os.environ.get("PATH", "")])
        self.env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1",
                    "QUIVER_SERVE__SERVER__PORT": str(self.port)}

    def run(self, block: Block) -> None:
        env = {**self.env, **block.env}
        text = localize(block.text, self.port)
        if block.lang == "yaml":
            yaml.safe_load(block.text)
        elif block.mode == "check":
            check(block)
        elif block.mode == "daemon":
            self.start_daemon(text, env, block)
        elif block.lang == "sh":
            self._run([shutil.which("bash") or "bash", "-euo", "pipefail", "-c", text], env, block)
        elif block.lang == "python":
            script = self.scratch / f"block_{block.line}.py"
            script.write_text(text)
            self._run([sys.executable, str(script)], env, block)

    def _run(self, argv: list[str], env: dict[str, str], block: Block) -> None:
        try:
            out = subprocess.run(argv, cwd=self.scratch, env=env, capture_output=True, text=True,
                                 timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{exc.stdout}")
        assert out.returncode == 0, (f"{block.where} exited {out.returncode}:\n{block.text}\n"
                                     f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n"
                                     f"{out.stderr[-3000:]}\n--- daemon\n{self.log()}")

    def start_daemon(self, text: str, env: dict[str, str], block: Block) -> None:
        self.stop()
        self.port = free_port()
        env["QUIVER_SERVE__SERVER__PORT"] = str(self.port)
        self.env["QUIVER_SERVE__SERVER__PORT"] = str(self.port)
        text = localize(block.text, self.port)
        log = open(self.daemon_log, "ab")  # noqa: SIM115 - the child holds it
        self.daemon = subprocess.Popen(["bash", "-c", text], cwd=self.scratch, env=env,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        log.close()
        wait_ready(self.daemon, self.port, block.ready_within_s or DAEMON_READY_S, block, self.log)

    def log(self) -> str:
        return self.daemon_log.read_text(errors="replace")[-4000:] if self.daemon_log.exists() else ""

    def stop(self) -> None:
        if self.daemon is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.daemon.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.daemon.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.daemon = None


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float, block: Block,
               log: object) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"{block.where}: the daemon exited ({proc.returncode}):\n{log()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{block.where}: not ready in {timeout_s:.0f} s:\n{log()}")


# ---- blocks that are not run here --------------------------------------------------------------
def check(block: Block) -> None:
    assert block.reason, f"{block.where}: a check block says why it is not run"
    if block.lang == "python":
        compile(block.text, block.where, "exec")
        return
    out = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert out.returncode == 0, f"{block.where}: bash cannot parse it: {out.stderr}"
    for command in commands(block.text):
        argv = _strip_prefix(shlex.split(command))
        if not argv:
            continue
        if argv[0] in ("python", "python3"):
            check_flags(argv, block)
        elif argv[0] == "make":
            check_make(argv, block)
        check_paths(argv, block)


def _strip_prefix(argv: list[str]) -> list[str]:
    """Drop ``VAR=value`` assignments and ``timeout N`` / ``sudo`` in front of the command."""
    while argv and (re.match(r"^\w+=", argv[0]) or argv[0] in ("sudo", "env")):
        argv = argv[1:]
    if argv[:1] == ["timeout"]:
        argv = argv[2:]
    return argv


def check_flags(argv: list[str], block: Block) -> None:
    """Every ``--flag`` of a python command is in its ``--help`` (of its sub-command, if any)."""
    rest = argv[1:]
    if rest[:1] == ["-m"]:
        target, rest = ["-m", rest[1]], rest[2:]
    elif rest and rest[0].endswith(".py"):
        target, rest = [rest[0]], rest[1:]
    else:
        return
    positionals = []
    for token in rest:
        if token.startswith("-"):
            break
        positionals.append(token)
    help_out = subprocess.run([sys.executable, *target, *positionals, "--help"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0, (f"{block.where}: {' '.join(target)} --help failed:\n"
                                      f"{help_out.stderr[-2000:]}")
    for flag in (t.split("=")[0] for t in rest if t.startswith("--")):
        assert flag in help_out.stdout, f"{block.where}: {' '.join(target)} has no flag {flag}"


def check_make(argv: list[str], block: Block) -> None:
    targets = [t for t in argv[1:] if not t.startswith("-") and "=" not in t]
    for target in targets:
        out = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), target], capture_output=True,
                             text=True)
        assert "No rule to make target" not in out.stderr, f"{block.where}: no make target {target}"


def check_paths(argv: list[str], block: Block) -> None:
    for token in argv:
        value = token.split("=", 1)[-1]
        if "/" in value and not value.startswith(("-", "http", "$", "/", "~", ".")) \
                and "<" not in value and "*" not in value and ":" not in value:
            first = value.split("/")[0]
            if (REPO_ROOT / first).exists():
                assert (REPO_ROOT / value).exists(), f"{block.where}: no such path {value}"


# ---- the tests ---------------------------------------------------------------------------------
def _pages() -> list[Path]:
    return [p for p in doc_files() if read_blocks(p)]


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    p = Page(Path(tempfile.mkdtemp(dir=tmp_path)))
    yield p
    p.stop()


def test_every_block_has_a_known_language() -> None:
    bad = [f"{b.where}: ```{b.lang}" for p in doc_files() for b in read_blocks(p)
           if b.lang not in RUN_LANGS | SHOW_LANGS]
    assert not bad, "blocks must say sh, python, yaml (run) or text/json (shown):\n" + "\n".join(bad)


def test_no_command_outside_a_fenced_block() -> None:
    found = [line for p in doc_files() for line in unfenced_commands(p)]
    assert not found, "commands in indented blocks escape this test; fence them:\n" + "\n".join(found)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_page_runs_as_written(path: Path, page: Page) -> None:
    for block in read_blocks(path):
        if block.lang in RUN_LANGS:
            t0 = time.monotonic()
            page.run(block)
            print(f"{block.where} ({block.lang}, {block.mode}): {time.monotonic() - t0:.1f} s")
