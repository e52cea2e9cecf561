"""``python -m quiver_serve.calibrate --config X.yaml``: compute the PSGS table and time every
sampling path now, save both where the daemon's engine cores look for them, print the lines.

The calibration is keyed by graph, fanouts and hardware (``routing/cost.py``); the daemon reuses it
while the key matches (``sampling.calibration: auto``). Engine core 0's device is calibrated.
"""

from __future__ import annotations

import argparse
import logging
import sys

from quiver_serve.config import ConfigError, ServeConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="serve config (YAML); default: the embedded default")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = ServeConfig.load(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    from quiver_serve.engine.core.build import build_core
    from quiver_serve.graph.datasets import load_graph
    from quiver_serve.routing.cost import cost_path

    graph = load_graph(cfg.graph)
    core = build_core(cfg, graph, 0, None, calibration="startup")
    print(f"PSGS table: {graph.describe()}, fanouts {cfg.sampling.fanouts}, "
          f"popularity exponent {core.psgs.alpha:.2f}" if core.psgs else "no PSGS table")
    for path, m in [*core.cost.paths.items(), ("model", core.cost.compute)]:
        print(f"  {path:5s}: {m.fixed_s * 1e3:.3f} ms + {m.per_seed_s * 1e6:.4f} us per sampled node")
        if m.has_points:  # what predictions follow
            print("         measured: " + ", ".join(f"{x:.0f} nodes {y * 1e3:.3f} ms"
                                                   for x, y in m.curve()))
    print(f"saved to {cost_path(core.cost.key)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
