"""Options every bench shares: ``--set section.key=value`` config overrides (validated through the
pydantic config, like the daemon's ``QUIVER_SERVE__SECTION__KEY`` environment overrides)."""

from __future__ import annotations

import argparse

from quiver_serve.config import ServeConfig, resolve_path


def add_set_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config field (YAML value), repeatable; e.g. "
                         "--set sampling.route=gpu --set sampling.gpu_mode=uva")


def load_config(path: str, sets: list[str] | None = None) -> ServeConfig:
    """The YAML at ``path`` (relative: from the repository root) with ``--set`` overrides."""
    cfg = ServeConfig.from_yaml(resolve_path(path))
    return cfg.with_overrides(sets) if sets else cfg
