"""PNG plots (matplotlib, Agg): throughput vs p99, and latency CDFs, several series per figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _plt():  # noqa: ANN202 - the pyplot module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PROTOCOL_COLOURS = {"http-json": "tab:blue", "http-npy": "tab:orange", "kserve-json": "tab:olive",
                    "kserve-binary": "tab:green", "grpc": "tab:red", "queue": "tab:purple"}
ROUTE_STYLES = {"auto": "-", "cpu": "--", "gpu": ":"}


def style(name: str) -> dict:
    """Line style of a series named ``[route/]protocol``: colour by protocol, dash by route; a
    series whose route is "baseline" is black with crosses."""
    route, _, protocol = name.rpartition("/")
    protocol = protocol.split(" ")[0]
    if route == "baseline":
        return {"color": "black" if protocol == "http-json" else "dimgrey", "marker": "x",
                "linestyle": "-."}
    return {"color": PROTOCOL_COLOURS.get(protocol), "linestyle": ROUTE_STYLES.get(route, "-"),
            "marker": "o"}


def throughput_vs_p99(series: dict[str, list[dict]], path: str | Path, title: str,
                      bounds_ms: tuple[float, ...] = (10.0, 30.0)) -> Path:
    """One line per series: each point's seed nodes/s (x) against its p99 (y, log scale)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    rates = []
    for name, points in series.items():
        # a point with nothing answered has no place on a log axis
        pts = [p for p in points if p["p99_ms"] is not None and p["seed_nodes_per_s"] > 0]
        if pts:
            rates += [p["seed_nodes_per_s"] for p in pts]
            ax.plot([p["seed_nodes_per_s"] for p in pts], [p["p99_ms"] for p in pts],
                    label=name, **style(name))
    ax.set_xscale("log")
    if rates:
        ax.set_xlim(min(rates) / 1.5, max(rates) * 1.5)
    for b in bounds_ms:
        ax.axhline(b, color="grey", linestyle="--", linewidth=0.8)
        ax.text(ax.get_xlim()[0], b, f" p99 = {b:g} ms", va="bottom", fontsize=8, color="grey")
    ax.set_yscale("log")
    return _save(plt, fig, ax, path, title, "seed nodes / s (answered)", "p99 latency (ms)")


def latency_cdf(series: dict[str, np.ndarray], path: str | Path, title: str) -> Path:
    """One CDF per series (latencies in ms, any order); x on a log scale."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, lat_ms in series.items():
        lat = np.sort(np.asarray(lat_ms, np.float64))
        if lat.size:
            st = {k: v for k, v in style(name).items() if k != "marker"}
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=f"{name} (n={lat.size})", **st)
    ax.set_xscale("log")
    return _save(plt, fig, ax, path, title, "latency (ms)", "fraction of requests")


def _save(plt: Any, fig: Any, ax: Any, path: str | Path, title: str, xlabel: str,
          ylabel: str) -> Path:
    """Labels, grid, legend beside the axes; written as PNG and closed."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
