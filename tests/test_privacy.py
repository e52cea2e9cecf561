"""No module reads or writes another module's or class's private (``_x``) names.

Every ``x._name`` in ``quiver_serve/``, ``bench/`` and ``loadtest/`` (read from the AST, nothing
imported), and every ``getattr``/``setattr``/``hasattr``/``delattr`` of a literal ``"_name"``, is
an error unless ``x`` is ``self``, ``cls`` or ``super()``, ``_name`` is a dunder, ``_name`` is one
the module defines itself (a module-level name, a function, method or class, or an attribute its
code assigns on ``self``/``cls``: a class may reach into another instance of itself), or the
access is on the allow-list below, each entry with its reason. ``from m import _name`` is an
error too. A class's state is reached through its public methods and properties;
docs/architecture.md ("Engine core") names the engine core's seams.

The test lists every violation at once, as ``path:line: expression``, so the list is easy to
act on.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the trees checked
TREES = ("quiver_serve", "bench", "loadtest")

#: private names of the standard library and of libraries, used on purpose: "*" allows the
#: name on any object; else the expression as written. Each with its reason.
ALLOWED = {
    "sys._getframe": "CPython's documented frame access",
    "os._exit": "ends a forked child without running the parent's exit handlers",
    "*._replace": "namedtuple's public API (underscored so it cannot clash with a field)",
    "*._asdict": "namedtuple's public API (underscored so it cannot clash with a field)",
    "*._fields": "namedtuple's public API (underscored so it cannot clash with a field)",
    "*._make": "namedtuple's public API (underscored so it cannot clash with a field)",
    "multiarray._reconstruct": "the function NumPy's pickles name: the safe unpickler of "
                               "graph/planetoid.py allows it by that name",
    "torch._addmm_activation": "GEMM + bias + ReLU in one kernel (the epilogue); PyTorch has "
                               "no public name for it",
    "conv._cached_edge_index": "PyG's GCNConv keeps its cache there; caching is turned off for "
                               "served models and the stale cache must go (no public reset)",
    "conv._cached_adj_t": "as conv._cached_edge_index",
    "serve._run": "Ray Serve's deploy without waiting: the public serve.run waits for RUNNING "
                  "with no timeout; the caller waits with its own",
    "tqdm._lock": "tqdm's class-wide lock, probed so the default one (a multiprocessing "
                  "semaphore) is never made",
}
ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _files() -> list[Path]:
    return [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Private names the module defines: module-level names, functions, methods and classes,
    and attributes its code assigns on ``self``/``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _is_own_object(base: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(base, ast.Name):
        return base.id in ("self", "cls")
    return isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
        and base.func.id == "super"


def _allowed(base: ast.expr, name: str) -> bool:
    return f"*.{name}" in ALLOWED or f"{ast.unparse(base)}.{name}" in ALLOWED


def _found(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(object, private name) that ``node`` reads or writes, if any."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        return node.value, node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ATTR_FUNCTIONS and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
            and _private(node.args[1].value):
        return node.args[0], node.args[1].value
    return None


def violations_in(path: Path, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(path, line, expression) of each violation in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    own = _own_names(tree)
    rel = str(path.relative_to(root))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(rel, node.lineno, f"from {node.module} import {a.name}")
                    for a in node.names if _private(a.name)]
            continue
        hit = _found(node)
        if hit is None:
            continue
        base, name = hit
        if _is_own_object(base) or name in own or _allowed(base, name):
            continue
        out.append((rel, getattr(node, "lineno", 0), ast.unparse(node)))
    return out


def test_no_private_names_of_others() -> None:
    found = sorted({v for p in _files() for v in violations_in(p)})
    listing = "\n".join(f"{path}:{line}: {expr}" for path, line, expr in found)
    assert not found, (f"{len(found)} reads or writes of another module's or class's private "
                       f"names (give the class a public method or property):\n{listing}")


def test_the_check_finds_what_it_must(tmp_path: Path) -> None:
    """The rule itself: another object's private name is found, in any of its spellings; its
    own, self's, super()'s and the allow-list's are not."""
    src = tmp_path / "m.py"
    src.write_text("import sys\n"
                   "from pkg import _hidden\n"
                   "class A(B):\n"
                   "    def __init__(self):\n"
                   "        self._mine = 1\n"
                   "        super()._setup()\n"
                   "    def same(self, other):\n"
                   "        return other._mine + self._mine\n"
                   "def f(core, mod, x):\n"
                   "    sys._getframe(0)\n"
                   "    x._replace(a=1)\n"
                   "    core._waiting_ids -= 1\n"
                   "    getattr(core, '_stream', None)\n"
                   "    setattr(core, 'public', 1)\n"
                   "    return mod._helper(core.__class__)\n")
    assert [(line, expr) for _, line, expr in violations_in(src, tmp_path)] == [
        (2, "from pkg import _hidden"), (12, "core._waiting_ids"),
        (13, "getattr(core, '_stream', None)"), (15, "mod._helper")]


def test_every_allowed_name_is_still_used() -> None:
    """An allow-list entry nothing uses any more goes (it would hide a new use)."""
    used = set()
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            hit = _found(node)
            if hit is not None:
                base, name = hit
                used.update({f"*.{name}", f"{ast.unparse(base)}.{name}"})
    unused = sorted(set(ALLOWED) - used - {"*._replace", "*._asdict", "*._fields", "*._make",
                                          "sys._getframe", "os._exit"})
    assert not unused, f"allow-list entries nothing uses: {unused}"
