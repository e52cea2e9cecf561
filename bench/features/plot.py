#!/usr/bin/env python
"""Hit rate vs GPU budget from bench/bench_features.py's JSON, as a PNG (needs matplotlib;
run where it is installed, e.g. locally after the GPU run).
    python bench/plot_features.py bench/results/features_h200.json docs/features_hit_rate.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
    if len(sys.argv) != 3:
        raise SystemExit("usage: plot_features.py RESULTS.json OUT.png")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
