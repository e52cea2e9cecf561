"""The code blocks a user is told to run, read from the project's markdown.

A fenced block's language says what it is: ``sh`` (shell commands, run with bash), ``python``
(a script), ``yaml`` (parsed), ``text``/``json``/``http`` (output or illustration: never run).
An HTML comment on the line before a fence says how the docs test treats it::

    <!-- doc-test: daemon [ready-within=S] -->   the block starts a server; later blocks talk to
                                         it (ready: /v2/health/ready answers 200, within S s)
    <!-- doc-test: check <reason> -->    not run here (GPU, docker, kubectl...): syntax, flags, paths
    <!-- doc-test: env K=V ... -->       extra environment for this block (documented variables)

Without a comment an ``sh`` or ``python`` block is run as written, against the file's daemon.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_LANGS = {"sh", "python", "yaml"}
SHOW_LANGS = {"text", "json", "http", "console-output", "promql"}

_FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: str
    line: int
    lang: str
    text: str
    mode: str = "run"  # run | daemon | check
    reason: str = ""
    ready_within_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    """Every page a user reads for commands: the READMEs and docs/*.md (not the history)."""
    names = ["README.md", "deploy/README.md", "bench/README.md", "loadtest/README.md"]
    files = [REPO_ROOT / n for n in names if (REPO_ROOT / n).exists()]
    return files + sorted((REPO_ROOT / "docs").glob("*.md"))


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(REPO_ROOT))
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        block = Block(rel, start + 1, lang, "\n".join(body) + "\n")
        _apply_directive(block, lines[start - 1] if start else "")
        blocks.append(block)
    return blocks


def _apply_directive(block: Block, previous: str) -> None:
    m = _DIRECTIVE.match(previous)
    if not m:
        return
    kind, rest = m.group(1), m.group(2)
    if kind == "env":
        block.env = dict(pair.split("=", 1) for pair in shlex.split(rest))
    elif kind == "daemon":
        block.mode = kind
        m_ready = re.search(r"ready-within=(\d+)", rest)
        block.ready_within_s = float(m_ready.group(1)) if m_ready else None
    elif kind == "check":
        block.mode, block.reason = kind, rest
    else:
        raise ValueError(f"{block.where}: unknown doc-test directive {kind!r}")


def commands(text: str) -> list[str]:
    """The shell block's commands, one per logical line (continuations joined, comments dropped)."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            out.append(current.strip())
        current = ""
    return out


def unfenced_commands(path: Path) -> list[str]:
    """Lines outside any fence that look like commands in an indented block: the runner would
    miss them, so the docs keep every command in a fenced block."""
    starts = ("make ", "python ", "python3 ", "curl ", "docker ", "kubectl ", "import ", "from ")
    found, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and line.startswith("    ") and line.strip().startswith(starts):
            found.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    return found
