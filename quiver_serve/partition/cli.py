"""``python -m quiver_serve.partition --config C --parts P --out DIR [--method M]
[--hot-budget-mb MB] [--set section.key=value ...]``: partition the graph a config serves and
write one snapshot folder per partition, the partition book and the stats
(docs/operations.md, "Partitioning a graph")."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quiver_serve.config import ConfigError, ServeConfig
from quiver_serve.partition.methods import AUTO, METHODS, resolve_method

if TYPE_CHECKING:
    from quiver_serve.graph.csc import GraphData
    from quiver_serve.partition.book import PartitionBook
    from quiver_serve.partition.data import PartitionData
    from quiver_serve.partition.stats import PartitionStats

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m quiver_serve.partition",
        description="Partition a config's graph across hosts: per partition a snapshot folder "
                    "(owned in-edge lists, features, replicated hot rows), plus the partition "
                    "book and stats.json.")
    parser.add_argument("--config", help="YAML config (default: $QUIVER_SERVE_CONFIG, else the "
                                         "embedded default, Cora)")
    parser.add_argument("--parts", type=int, required=True, help="number of partitions (>= 1)")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder (new or empty)")
    parser.add_argument("--method", choices=(AUTO, *METHODS),
                        help="override partition.method (auto: metis up to "
                             "partition.metis_max_edges, partition.fallback above)")
    parser.add_argument("--hot-budget-mb", type=float,
                        help="override partition.hot_budget_mb (replicated rows per partition)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field (repeatable)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Partition and write; returns the exit status."""
    from quiver_serve.graph.datasets import load_graph
    from quiver_serve.partition.data import save_partitions

    cfg = ServeConfig.load(args.config).with_overrides(args.set) if args.set \
        else ServeConfig.load(args.config)
    part_cfg = cfg.partition
    method = args.method or part_cfg.method
    budget_mb = part_cfg.hot_budget_mb if args.hot_budget_mb is None else args.hot_budget_mb
    if args.parts < 1:
        raise ValueError(f"--parts must be >= 1, got {args.parts}")
    if budget_mb < 0:
        raise ValueError(f"--hot-budget-mb must be >= 0, got {budget_mb}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty folder")
    t0 = time.perf_counter()
    graph = load_graph(cfg.graph)
    load_s = time.perf_counter() - t0
    method = resolve_method(method, graph.num_edges, part_cfg.metis_max_edges, part_cfg.fallback)
    book, parts, stats = _partition(graph, args.parts, method, budget_mb, cfg)
    stats.phase_s = {"load": load_s, **stats.phase_s}
    t0 = time.perf_counter()
    save_partitions(out, book, parts, stats, graph.name)
    stats.phase_s["write"] = time.perf_counter() - t0
    # stats.json again, now with the write's seconds (the book is already in place)
    _rewrite_stats(out, stats)
    print(stats.text())
    print(f"wrote {args.parts} partitions of {graph.name} to {out}")
    return 0


def _partition(graph: GraphData, num_parts: int, method: str, budget_mb: float,
               cfg: ServeConfig) -> tuple[PartitionBook, list[PartitionData], PartitionStats]:
    from quiver_serve.partition.data import partition_graph

    return partition_graph(graph, num_parts, method, hot_budget_bytes=int(budget_mb * 1e6),
                           fap_fanouts=list(cfg.sampling.fanouts), seed=cfg.partition.seed,
                           fap_batch_size=cfg.features.fap_batch_size)


def _rewrite_stats(out: Path, stats: PartitionStats) -> None:
    import json

    from quiver_serve.graph.base_files import write_synced
    from quiver_serve.partition.data import STATS_NAME

    tmp = out / (STATS_NAME + ".tmp")
    write_synced(tmp, json.dumps(stats.to_json(), indent=2).encode())
    tmp.replace(out / STATS_NAME)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, ValueError, FileExistsError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
