"""Where the package's own files are, and how a path written in a config is read.

The embedded default (its config, Cora with its licence, the GraphSAGE weights) is package data
in :data:`DEFAULTS_DIR`, found from this package's folder: the same in a checkout and in an
installed package. A relative path in a config is taken from where it was written: a YAML file's
folder, else the working directory (:func:`anchor_paths`, :func:`resolve_path`); docs/config.md,
"Paths", and docs/decisions/0038-package-data.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: the folder of the ``quiver_serve`` package (a checkout's, or an installed one in site-packages)
PACKAGE_DIR = Path(__file__).resolve().parent
#: the embedded default, package data: its config, Cora (with its licence) and the GraphSAGE
#: trained on it (models/README.md)
DEFAULTS_DIR = PACKAGE_DIR / "defaults"
DEFAULT_CONFIG_PATH = DEFAULTS_DIR / "default.yaml"
#: the config fields that name a file or folder, as (section, key)
PATH_FIELDS = (("graph", "path"), ("graph", "update_log_dir"), ("model", "weights"),
               ("models", "repository"))


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Absolute paths stay; relative ones are taken from the working directory. A config loaded
    from a file holds only absolute paths (:func:`anchor_paths`): this reaches configs built
    in Python and command-line arguments."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path.cwd() / p


def anchor_paths(raw: dict[str, Any], base: Path) -> None:
    """Every :data:`PATH_FIELDS` value in ``raw`` (a config as YAML data) made absolute, a
    relative one from ``base``, in place; other values are left for validation to judge."""
    for section, key in PATH_FIELDS:
        part = raw.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if isinstance(value, str) and value:
            path = Path(value).expanduser()
            part[key] = str(path) if path.is_absolute() else os.path.normpath(base / path)


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as the daemon shows it to clients and in docs: one inside the package from the
    folder that holds the package (``quiver_serve/defaults/...``, the same in a checkout and in
    site-packages), any other as given."""
    try:
        return Path(path).resolve().relative_to(PACKAGE_DIR.parent).as_posix()
    except ValueError:
        return str(path)
