#!/usr/bin/env python
"""Hit rate vs GPU budget from bench.features.features' JSON, as a PNG (needs matplotlib;
run where it is installed, e.g. locally after the GPU run).
    python -m bench.features.plot bench/results/features_h200_2026-11-23_placement.json hit_rate.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"fap": ("FAP (uniform seeds)", "-o"), "degree": ("in-degree", "--s"),
         "fap-log": ("FAP (request log)", ":^")}


def main(src: Path, dst: Path) -> None:
    rows = json.loads(src.read_text())["gather"]
    panels = sorted({(r["graph"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (graph, workload) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if r["graph"] == graph and r["workload"] == workload
                and r["budget"].endswith("%")]
        for order, (label, style) in STYLE.items():
            pts = sorted((int(r["budget"][:-1]), r["hit_rate"]) for r in mine
                         if r["order"] == order)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_title(f"{graph}, workload ({workload})")
        ax.set_xlabel("GPU budget, % of feature bytes")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("hit rate (rows from GPU memory)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=120)
    print(f"wrote {dst}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.features.plot",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("results", type=Path, help="a features_* JSON (bench.features.features)")
    ap.add_argument("png", type=Path, help="the plot to write")
    args = ap.parse_args()
    main(args.results, args.png)
