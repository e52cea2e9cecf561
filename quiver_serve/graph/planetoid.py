"""Planetoid raw folders (``ind.<name>.*``), read without running code from the files.

The ``ind.*`` files are pickles (Python 2 ones for the published Cora, CiteSeer and PubMed) of
numpy arrays, scipy sparse matrices and a ``defaultdict`` of lists. PyG's reader unpickles them
with ``pickle.load``, which calls whatever a crafted file names (``os.system``, ``eval``); a
folder named in a config must not be able to do that. :class:`SafePlanetoidUnpickler` resolves
only the globals these files hold and refuses the rest before anything runs; the arrays are then
assembled exactly as PyG's ``torch_geometric.io.read_planetoid_data`` does (non-NELL branch).
"""

from __future__ import annotations

import codecs
import collections
import functools
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

_NAMES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


class UnsafePickleError(ValueError):
    """A Planetoid file names a global outside the allow-list; nothing in it was run."""


@functools.cache
def allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) as written in the pickle -> the object it may resolve to.

    Python 2 names (``__builtin__``) and the module paths of old and current numpy
    (``numpy.core`` / ``numpy._core``) and scipy (``scipy.sparse.csr`` / ``scipy.sparse._csr``)
    are listed explicitly, so a name is never imported on a file's say-so.
    """
    import scipy.sparse as sp

    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "defaultdict"): collections.defaultdict,
        # Python 3 pickles (protocol <= 2) store bytes as _codecs.encode(str, "latin1").
        ("_codecs", "encode"): codecs.encode,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = multiarray._reconstruct
        allowed[(module, "scalar")] = multiarray.scalar  # numpy scalars: dtype + raw bytes
    for cls in ("csr_matrix", "csc_matrix", "lil_matrix", "coo_matrix"):
        fmt = cls.split("_")[0]
        for module in ("scipy.sparse", f"scipy.sparse.{fmt}", f"scipy.sparse._{fmt}"):
            allowed[(module, cls)] = getattr(sp, cls)
    for module in ("builtins", "__builtin__"):
        for builtin in (list, dict, set, tuple, int, float):
            allowed[(module, builtin.__name__)] = builtin
    return allowed


class SafePlanetoidUnpickler(pickle.Unpickler):
    """Unpickles only what Planetoid files hold; errors name the file and the refused global."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="latin1")  # Python 2 str holds raw bytes, as PyG reads
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        obj = allowed_globals().get((module, name))
        if obj is None:
            raise UnsafePickleError(
                f"{self.path}: refused: the pickle asks for the global {module}.{name}, which a "
                f"Planetoid file never holds (nothing in the file was run)"
            )
        return obj


def load_pickle(path: Path) -> Any:
    """One ``ind.*`` pickle through the restricted unpickler; every failure names the file."""
    try:
        with open(path, "rb") as f:
            return SafePlanetoidUnpickler(f, path).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle fails in many ways; all say so
        raise ValueError(f"{path}: not a readable Planetoid pickle: {exc}") from exc


def _read_matrix(path: Path) -> Tensor:
    """An array or sparse matrix file as a dense float tensor (as PyG's ``read_file``)."""
    import scipy.sparse as sp

    out = load_pickle(path)
    if sp.issparse(out):
        out = np.asarray(out.todense())
    if not isinstance(out, np.ndarray) or out.ndim != 2:
        raise ValueError(f"{path}: expected a 2-D array or sparse matrix, got {type(out).__name__}")
    return torch.from_numpy(out).to(torch.float)


def _read_graph(path: Path) -> dict[int, list[int]]:
    out = load_pickle(path)
    if not isinstance(out, dict) or not all(
        isinstance(k, int) and isinstance(v, list) and all(isinstance(u, int) for u in v)
        for k, v in out.items()
    ):
        raise ValueError(f"{path}: expected a dict of node id -> list of neighbour ids")
    return out


def read_planetoid(raw_dir: Path, prefix: str) -> tuple[Tensor, Tensor, Tensor]:
    """(x, edge_index, y) of a Planetoid raw folder, as ``read_planetoid_data`` builds them."""
    from torch_geometric.io import read_txt_array
    from torch_geometric.io.planetoid import edge_index_from_dict

    if prefix == "nell.0.001":
        raise ValueError(f"{raw_dir}: Planetoid NELL is not supported (its 61,278 sparse "
                         f"relation features would be served dense)")
    paths = {name: raw_dir / f"ind.{prefix}.{name}" for name in _NAMES}
    x, tx, allx, y, ty, ally = (_read_matrix(paths[n]) for n in ("x", "tx", "allx", "y", "ty", "ally"))
    graph = _read_graph(paths["graph"])
    test_index = read_txt_array(str(paths["test.index"]), dtype=torch.long)
    sorted_test_index = test_index.sort()[0]
    if prefix == "citeseer":
        # CiteSeer has isolated test nodes missing from tx/ty: zero rows fill the gaps (as PyG).
        span = int(test_index.max() - test_index.min()) + 1
        tx_ext = torch.zeros(span, tx.size(1), dtype=tx.dtype)
        tx_ext[sorted_test_index - test_index.min(), :] = tx
        ty_ext = torch.zeros(span, ty.size(1), dtype=ty.dtype)
        ty_ext[sorted_test_index - test_index.min(), :] = ty
        tx, ty = tx_ext, ty_ext
    x = torch.cat([allx, tx], dim=0)
    x[test_index] = x[sorted_test_index]
    y = torch.cat([ally, ty], dim=0).max(dim=1)[1]
    y[test_index] = y[sorted_test_index]
    edge_index = edge_index_from_dict(graph_dict=graph, num_nodes=y.size(0))
    return x, edge_index.as_subclass(Tensor), y
