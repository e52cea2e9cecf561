"""The class of a served model: a class of ``torch_geometric.nn.models`` by name, or the
operator's ``package.module:Class`` imported from the model's repository folder first.

Specs come only from the operator's files (the ``model:`` config section or the model
repository), never from a request: resolving one imports the operator's code.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from quiver_serve.config import ModelConfig
from quiver_serve.models.spec import IMPORT_PATH, ModelSpec

#: PyG's message-passing GNNs (``BasicGNN``): every one takes ``in_channels``
BASIC_GNN_CLASSES = ("EdgeCNN", "GAT", "GCN", "GIN", "GraphSAGE", "PNA")
_IMPORT_LOCK = threading.Lock()


# ---- the model class ---------------------------------------------------------------------------
def resolve_model_class(spec: ModelSpec | ModelConfig) -> type[nn.Module]:
    """The ``torch.nn.Module`` subclass ``spec.pyg_class`` names: a class of
    ``torch_geometric.nn.models`` by name, or ``package.module:Class`` imported from
    ``spec.module_dir`` first, else by the normal import system. Operator files only (imports
    their code). ValueError naming the class and the cause when it cannot be had."""
    spec = ModelSpec.coerce(spec)
    if spec.is_import_path:
        return _import_class(spec.pyg_class, spec.module_dir)
    return _pyg_class(spec.pyg_class)


def _pyg_class(name: str) -> type[nn.Module]:
    from torch_geometric.nn import models as pyg_models

    found = getattr(pyg_models, name, None) if not name.startswith("_") else None
    if not (inspect.isclass(found) and issubclass(found, nn.Module)):
        raise ValueError(f"model class {name!r} is not in torch_geometric.nn.models (its "
                         f"message-passing GNNs: {', '.join(BASIC_GNN_CLASSES)}); name a class "
                         "of your own as 'package.module:Class'")
    return found


def _import_class(path: str, module_dir: str | None) -> type[nn.Module]:
    if not IMPORT_PATH.fullmatch(path):
        raise ValueError(f"model class {path!r} is not an import path 'package.module:Class'")
    module_name, _, attr = path.partition(":")
    try:
        module = import_model_module(module_name, module_dir)
    except Exception as exc:
        origin = "the model's folder, then sys.path" if module_dir else "sys.path"
        raise ValueError(f"cannot import {path!r} ({module_name!r} from {origin}): "
                         f"{type(exc).__name__}: {exc}") from exc
    found: Any = module
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ValueError(f"cannot import {path!r}: module {module_name!r} has no "
                             f"attribute {attr!r}")
    if not (inspect.isclass(found) and issubclass(found, nn.Module)):
        raise ValueError(f"{path!r} is not a torch.nn.Module subclass (got {found!r})")
    return found


def import_model_module(module_name: str, module_dir: str | None = None) -> ModuleType:
    """``module_name`` from ``module_dir`` when that folder holds its top-level module (a
    ``<top>.py`` file or a ``<top>/`` package), else from the normal import system.

    A module from a model's folder is executed under a name unique to its folder and contents
    (``_quiver_model_<hash>_<top>``): two models' folders may each hold a ``custom_gnn.py``, and
    an edited file is imported afresh on the next load (PyG caches code it generates for a
    message-passing class by module and class name). The folder is first on ``sys.path`` while
    the module runs, so it may import its siblings by plain name; ``sys.path`` is restored
    afterwards. Same contents, same folder: the module is imported once per process."""
    top = module_name.split(".")[0]
    source = _top_module_source(Path(module_dir), top) if module_dir else None
    if source is None:
        return importlib.import_module(module_name)
    unique = f"_quiver_model_{_fingerprint(source)}_{top}"
    with _IMPORT_LOCK, _first_on_path(source.parent):
        importlib.invalidate_caches()
        if unique not in sys.modules:
            _exec_top_module(unique, source)
        return importlib.import_module(unique + module_name[len(top):])


def _top_module_source(folder: Path, top: str) -> Path | None:
    if (folder / f"{top}.py").is_file():
        return folder / f"{top}.py"
    if (folder / top / "__init__.py").is_file():
        return folder / top
    return None


def _fingerprint(source: Path) -> str:
    """Hash of the module's resolved path and of every ``.py`` file it consists of."""
    digest = hashlib.sha256(str(source.resolve()).encode())
    files = [source] if source.is_file() else sorted(source.rglob("*.py"))
    for path in files:
        digest.update(str(path.relative_to(source.parent)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextmanager
def _first_on_path(folder: Path) -> Iterator[None]:
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if sys.path and sys.path[0] == entry:
            del sys.path[0]
        elif entry in sys.path:
            sys.path.remove(entry)


def _exec_top_module(unique: str, source: Path) -> None:
    if source.is_dir():
        spec = importlib.util.spec_from_file_location(
            unique, source / "__init__.py", submodule_search_locations=[str(source)])
    else:
        spec = importlib.util.spec_from_file_location(unique, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module  # PyG's inspector reads sys.modules[cls.__module__]
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[unique]
        raise
