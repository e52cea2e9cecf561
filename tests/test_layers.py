"""The package's folders are the pipeline's parts, and imports only run downward.

Every import in ``quiver_serve/`` (module level, in functions, under ``TYPE_CHECKING``: all read
from the AST, nothing imported) goes from a module to one of its own rank or lower, and no two
modules import each other, directly or around a circle. The ranks are the architecture's
(docs/architecture.md, "The folder tree"); a new package gets a rank here or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quiver_serve"

#: higher imports lower; equal ranks may import each other (without a circle)
RANKS = {
    "quiver_serve.scaleout": 9,
    "quiver_serve.frontend": 8,
    "quiver_serve.engine.client": 7,
    "quiver_serve.engine.procs": 6,
    "quiver_serve.engine.core": 5,
    "quiver_serve.routing": 4,
    "quiver_serve.partition": 4,
    "quiver_serve.features": 3,
    "quiver_serve.models": 3,
    "quiver_serve.sampling": 2,
    "quiver_serve.graph": 1,
    "quiver_serve.ops": 1,
    "quiver_serve.metrics": 1,
    "quiver_serve.config": 0,
    "quiver_serve.paths": 0,
    "quiver_serve.envs": 0,
    "quiver_serve.errors": 0,
    "quiver_serve.messages": 0,
    "quiver_serve.wire": 0,
}
#: entry points: they may import anything, and nothing imports them
ENTRY_POINTS = {"quiver_serve", "quiver_serve.__main__", "quiver_serve.calibrate", "quiver_serve.cli",
                "quiver_serve.engine"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rank(module: str) -> int | None:
    best = None
    for prefix, r in RANKS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[0])):
            best = (prefix, r)
    return None if best is None else best[1]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("quiver_serve"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("quiver_serve"):
            for a in node.names:  # ``from quiver_serve.x import y``: y may be a module
                sub = f"{node.module}.{a.name}"
                found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or \
        (PACKAGE.parent / rel / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_rank() -> None:
    missing = [m for m in graph() if m not in ENTRY_POINTS and rank(m) is None]
    assert not missing, f"modules outside every ranked package (add a rank): {missing}"


def test_imports_only_run_downward() -> None:
    upward = []
    for module, targets in graph().items():
        if module in ENTRY_POINTS:
            continue
        for target in targets:
            if target in ENTRY_POINTS and target != "quiver_serve":
                upward.append(f"{module} -> {target} (an entry point)")
            elif (rank(target) or 0) > (rank(module) or 0):
                upward.append(f"{module} (rank {rank(module)}) -> {target} (rank {rank(target)})")
    assert not upward, "imports that run upward:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    g = graph()
    circles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if t not in g or t == m:
                continue
            if state.get(t) == 1:
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    # ``quiver_serve/__init__.py`` loads its exports lazily (importlib), so it is no arrow
    circles = [c for c in circles if not c.startswith("quiver_serve -> ")]
    assert not circles, "import circles:\n" + "\n".join(circles)
