"""A typed start is a map (decision 0059): the graph phase of a typed daemon's start, first and
again, on the same update-log folder.

The first ``typed_graph_at_start`` generates the ogbn-mag-shaped synthetic graph (--scale, reverse
relations) and writes it as the base of version 0; the second loads that base without the
dataset, as every later start of the writer and of each engine core does. Reports both times,
their ratio and the base's bytes on disk.

    python -m bench.typed.start_map --scale 1.0 --out bench/results/typed_start_cpu2_<date>.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from loadtest import results
from quiver_serve.config import GraphConfig
from quiver_serve.graph.typed_base import typed_graph_at_start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = GraphConfig(format="synthetic", synthetic_preset="mag", synthetic_scale=args.scale,
                      name="mag", add_reverse_edges=True)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "log"
        t0 = time.perf_counter()
        graph, _ = typed_graph_at_start(cfg, folder, write_snapshot=True)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        again, version = typed_graph_at_start(cfg, folder)
        again_s = time.perf_counter() - t0
        disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        assert again.num_nodes == graph.num_nodes and version == 0
        result = {"graph": graph.describe(), "first_start_s": round(first_s, 2),
                  "again_s": round(again_s, 2), "ratio": round(again_s / first_s, 3),
                  "base_bytes": disk}
        print(result)
        if args.out is not None:
            results.write_result(args.out, {"meta": results.run_meta(args, **vars(args)),
                                            "result": result}, d)


if __name__ == "__main__":
    main()
