"""Measured latency models: a line in a batch's size, and the cost model of every sampling path.

``LatencyModel``: least-squares line over a sliding window (O(1) per batch) for the planners'
algebra, and the measured curve (one point per half-octave of size) that predictions follow, where
a line cannot (a cache cliff, a per-batch cost that only small batches pay). The engine core uses
one in seed count for when the batch now on the GPU finishes (so the next one is formed as late
as possible, with as many requests as possible, but in time to keep the GPU busy) and for the
expected fill's hold.

``CostModel``: per sampling path (GPU sampler, C++ sampler in the engine, CPU sampler pool) the
sampling latency as a line in the batch's PSGS (predicted unique nodes, ``routing/psgs.py``), and
the gather + model time as a line in the same size. Calibrated by timing every path over a range
of batch sizes (``engine/core/calibrate.py``, at start-up or with ``python -m quiver_serve.calibrate``),
saved as JSON keyed by graph, fanouts and hardware, reloaded when the key matches, and refined
online from each batch's measured times. The router sends a batch to the path predicted to finish
first; the batch former sizes batches to the deadline with the same lines.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: the measured curve's size buckets, half an octave each: ``floor(2 log2(x))``, 0 .. 95
CURVE_BUCKETS = 96
#: a bucket's point is the mean of its first CURVE_MAX_N batches, then an EWMA of 1 / that
CURVE_MAX_N = 8
#: one batch moves its bucket's point to at most this factor of it (a stalled host is one batch)
CURVE_CLIP = 4.0
#: a calibrated point counts as this many batches of its bucket
CURVE_CALIBRATED_N = 4


class LatencyModel:
    """Latency as a function of a batch's size: a least-squares line ``fixed_s + per_seed_s *
    x`` over a sliding window of measured batches (running sums: O(1) per batch on the serving
    path), anchored by a prior, and the measured curve that :meth:`predict_s` follows.

    A calibrated line (:meth:`set_line`) is kept as ``weight`` fixed points spread over the
    calibrated range, beside the window and never evicted. Measured batches move the line where
    they are (128 of them outweigh the 32 prior points), but batches of one size cannot turn it:
    without the anchor, a window holding only one-seed GPU batches (1.3 ms each, their staging
    for CUDA graphs included) fitted 4.7 us per sampled node, predicted 306 ms for a 384-seed
    batch that takes 0.3 ms, and the router never sent the GPU another batch to learn otherwise
    (docs/decisions/0003-cost-model-anchor.md).

    The line is the trend that the batch former's and the overlap planner's algebra use. The
    prediction is the curve: one point per half-octave of size (the mean size and latency
    of the batches and calibrated points seen there), linear between neighbouring points; past
    the largest, the line's slope from it; below the smallest, the line's shape scaled to it.
    A line over a curve misses both ends: on two CPU cores the model's time per Cora node jumps
    2.7x between 862 and 1,766 nodes (the gathered features leave the cache), and the fitted
    line predicted one-seed batches 5x short and 48-seed ones 1.8x long
    (docs/decisions/0034-cost-curves.md)."""

    def __init__(self, window: int = 128, prior_fixed_s: float = 1e-3,
                 prior_per_seed_s: float = 1e-6) -> None:
        self._points: deque[tuple[float, float]] = deque()
        self._window = window
        self._sums = [0.0, 0.0, 0.0, 0.0]  # x, y, xx, xy of the window
        self._prior = [0.0, 0.0, 0.0, 0.0]  # x, y, xx, xy of the anchor points
        self._prior_n = 0
        self.fixed_s = prior_fixed_s
        self.per_seed_s = prior_per_seed_s
        self._reset_curve()

    def observe(self, seeds: int, seconds: float) -> None:
        x, y = float(seeds), float(seconds)
        self._points.append((x, y))
        self._add(self._sums, x, y, 1.0)
        if len(self._points) > self._window:
            self._add(self._sums, *self._points.popleft(), -1.0)
        self._fit()
        self._remember(x, y, 1)

    @staticmethod
    def _add(sums: list[float], x: float, y: float, sign: float) -> None:
        sums[0] += sign * x
        sums[1] += sign * y
        sums[2] += sign * x * x
        sums[3] += sign * x * y

    def _fit(self) -> None:
        n = len(self._points) + self._prior_n
        if n <= 0:
            return
        sx, sy, sxx, sxy = (a + b for a, b in zip(self._sums, self._prior, strict=True))
        mean_x, mean_y = sx / n, sy / n
        var_x = sxx / n - mean_x * mean_x
        if n < 2 or var_x <= 1e-9 * max(mean_x * mean_x, 1.0):
            # one size seen: scale the fixed term only
            self.fixed_s = max(mean_y - self.per_seed_s * mean_x, 0.0)
            return
        slope = max((sxy / n - mean_x * mean_y) / var_x, 0.0)
        self.per_seed_s = slope
        self.fixed_s = max(mean_y - slope * mean_x, 0.0)

    # ---- the measured curve: one point per size bucket ---------------------------------------
    def _reset_curve(self) -> None:
        self._bx = [0.0] * CURVE_BUCKETS  # per bucket: mean size, mean latency, batches
        self._by = [0.0] * CURVE_BUCKETS
        self._bn = [0] * CURVE_BUCKETS
        self._xs: list[float] = []  # the points of the buckets that have one, by size
        self._ys: list[float] = []
        self._at = [-1] * CURVE_BUCKETS  # bucket -> index in _xs (-1: none)
        self._first = [0] * CURVE_BUCKETS  # bucket -> points in the buckets below it

    @staticmethod
    def _bucket(x: float) -> int:
        return min(int(2.0 * math.log2(x)), CURVE_BUCKETS - 1) if x >= 1.0 else 0

    def _remember(self, x: float, y: float, count: int) -> None:
        if not (y > 0.0 and math.isfinite(y) and math.isfinite(x)):
            return
        k = self._bucket(x)
        n = min(self._bn[k] + count, CURVE_MAX_N)
        if self._bn[k]:
            y = min(max(y, self._by[k] / CURVE_CLIP), self._by[k] * CURVE_CLIP)
        w = min(1.0, count / n)
        self._bx[k] += w * (x - self._bx[k])
        self._by[k] += w * (y - self._by[k])
        self._bn[k] = n
        i = self._at[k]
        if i >= 0:  # sizes stay inside their bucket: the order holds
            self._xs[i], self._ys[i] = self._bx[k], self._by[k]
            return
        seen = [j for j in range(CURVE_BUCKETS) if self._bn[j]]
        self._xs = [self._bx[j] for j in seen]
        self._ys = [self._by[j] for j in seen]
        self._at = [-1] * CURVE_BUCKETS
        for i, j in enumerate(seen):
            self._at[j] = i
        below = 0
        for j in range(CURVE_BUCKETS):
            self._first[j] = below
            below += self._bn[j] > 0

    @property
    def sizes(self) -> list[float]:
        """The measured curve's sizes (where its segments meet), ascending; not a copy."""
        return self._xs

    def curve(self) -> list[tuple[float, float]]:
        """The measured curve's points ``(x, seconds)``, by size."""
        return list(zip(self._xs, self._ys, strict=True))

    @property
    def has_points(self) -> bool:
        """Whether predictions follow measured points (else they are the bare line)."""
        return bool(self._xs)

    def predict_s(self, seeds: float) -> float:
        x, xs = float(seeds), self._xs
        if not xs:
            return self.fixed_s + self.per_seed_s * x
        i = self._first[self._bucket(x)]  # the first point at or past x's bucket
        if i < len(xs) and xs[i] <= x:
            i += 1  # x's own bucket's point lies below x
        ys = self._ys
        if i == len(xs):  # past the largest point: the line's slope from it
            return ys[-1] + self.per_seed_s * (x - xs[-1])
        if i == 0:  # below the smallest: the line's shape, scaled to it
            at = self.fixed_s + self.per_seed_s * xs[0]
            return ys[0] * (self.fixed_s + self.per_seed_s * max(x, 0.0)) / at if at > 0 else ys[0]
        x0, x1, y0 = xs[i - 1], xs[i], ys[i - 1]
        return y0 + (ys[i] - y0) * (x - x0) / (x1 - x0) if x1 > x0 else ys[i]

    def max_seeds_within(self, budget_s: float, cap: int) -> int:
        """The most seeds (at least 1, at most ``cap``) predicted to finish inside ``budget_s``."""
        line_x = float(cap) if self.per_seed_s <= 0 else \
            (budget_s - self.fixed_s) / self.per_seed_s
        if not self._xs:
            return max(1, min(cap, int(line_x)))
        return max(1, int(largest_within(self.predict_s, budget_s, 1.0, float(cap), self._xs)))

    def set_line(self, fixed_s: float, per_x_s: float,
                 x_range: tuple[float, float] | None = None, weight: int = 32,
                 points: list[tuple[float, float]] | None = None) -> None:
        """Start from a calibrated line: the window is emptied and the line becomes the anchor,
        ``weight`` points on it over ``x_range`` (log-spaced), so measured batches move the line
        gradually, one outlier (a busy host) cannot replace it, and batches of one size cannot
        tilt it far from the calibrated slope. ``points``: the measured ``(x, seconds)`` the line
        was fitted on; they start the curve (each as CURVE_CALIBRATED_N batches)."""
        self._points.clear()
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self._prior = [0.0, 0.0, 0.0, 0.0]
        self._prior_n = 0
        self.fixed_s, self.per_seed_s = max(fixed_s, 0.0), max(per_x_s, 0.0)
        if x_range is not None and weight > 0:
            lo, hi = max(x_range[0], 1.0), max(x_range[1], x_range[0] + 1.0, 2.0)
            for x in np.geomspace(lo, hi, weight):
                x = float(x)
                self._add(self._prior, x, self.fixed_s + self.per_seed_s * x, 1.0)
            self._prior_n = weight
        self._reset_curve()
        for x, y in points or ():
            self._remember(float(x), float(y), CURVE_CALIBRATED_N)


def largest_within(predict_s: Callable[[float], float], budget_s: float, lo: float, hi: float,
                   breaks: list[float]) -> float:
    """The largest ``x`` in ``[lo, hi]`` with ``predict_s(x) <= budget_s`` (``lo`` when none),
    for a ``predict_s`` linear between the ``breaks`` (the curves' points) that grows with ``x``
    (a measured curve may dip a little between points: the search assumes it does not): a
    binary search over the breaks, then the segment's line solved (a few predictions)."""
    nodes = [lo, *sorted(b for b in breaks if lo < b < hi), hi]
    if predict_s(hi) <= budget_s:
        return hi
    if predict_s(lo) > budget_s:
        return lo
    i, j = 0, len(nodes) - 1  # predict(nodes[i]) <= budget < predict(nodes[j])
    while j - i > 1:
        m = (i + j) // 2
        if predict_s(nodes[m]) <= budget_s:
            i = m
        else:
            j = m
    x0, x1 = nodes[i], nodes[j]
    y0, y1 = predict_s(x0), predict_s(x1)
    return x0 + (x1 - x0) * (budget_s - y0) / (y1 - y0)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(fixed_s, per_x_s)`` through ``(x, seconds)`` points (both >= 0)."""
    if not points:
        raise ValueError("no points to fit")
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if len(points) < 2 or float(np.ptp(x)) <= 0:
        return float(y.mean()), 0.0
    slope = max(float(np.polyfit(x, y, 1)[0]), 0.0)
    return max(float(y.mean() - slope * x.mean()), 0.0), slope


# ---- the cost model of every sampling path (PSGS-based; routing and batch sizing) -------------
#: sampling paths: "gpu" = this engine's GPU sampler; "local" = the C++ sampler in the engine
#: thread; "cpu" = a CPU sampler process of the pool (sampling time + the hop there and back)
PATHS = ("gpu", "local", "cpu")
#: prior lines (fixed_s, per sampled node s) before calibration or any measured batch
PRIORS = {"gpu": (8e-5, 5e-9), "local": (2e-5, 2e-7), "cpu": (2e-4, 2e-7)}
PRIOR_COMPUTE = (1e-3, 1e-6)
COST_VERSION = 2  # 2: the calibrated points (the curves' start) saved too


class CostModel:
    """Latency per path as a line in the batch's sampled-graph size (PSGS), and the model's
    compute time as a line in the same size. Lines start from a calibration (``calibrate``
    command or start-up) and follow the measured batches online (``LatencyModel``'s window)."""

    def __init__(self, lines: dict[str, tuple[float, float]] | None = None,
                 compute: tuple[float, float] = PRIOR_COMPUTE, key: dict | None = None,
                 hop_s: float | None = None,
                 x_range: tuple[float, float] = (10.0, 10_000.0),
                 points: dict[str, list[tuple[float, float]]] | None = None) -> None:
        """``points``: per path (and ``"compute"``) the calibrated ``(x, seconds)`` its line was
        fitted on (they start the line's measured curve; saved with the model)."""
        lines = {**PRIORS, **(lines or {})}
        self.x_range = (float(x_range[0]), float(x_range[1]))
        self.points = {k: [(float(x), float(y)) for x, y in v] for k, v in (points or {}).items()}
        self.paths = {p: LatencyModel() for p in PATHS}
        for p, (a, b) in lines.items():
            self.paths[p].set_line(a, b, self.x_range, points=self.points.get(p))
        self.compute = LatencyModel()
        self.compute.set_line(*compute, self.x_range, points=self.points.get("compute"))
        self.key = dict(key or {})
        #: the pool's hop there and back, on top of the C++ sampling time
        self.hop_s = PRIORS["cpu"][0] - PRIORS["local"][0] if hop_s is None else hop_s
        self.calibrated = False

    def sample_s(self, path: str, psgs: float) -> float:
        return self.paths[path].predict_s(psgs)

    def batch_s(self, path: str, psgs: float) -> float:
        """Predicted batch latency on ``path``: sampling plus gather and model."""
        return self.paths[path].predict_s(psgs) + self.compute.predict_s(psgs)

    def observe_sample(self, path: str, sampled_nodes: int, seconds: float) -> None:
        self.paths[path].observe(sampled_nodes, seconds)

    def observe_compute(self, sampled_nodes: int, seconds: float) -> None:
        self.compute.observe(sampled_nodes, seconds)

    def max_psgs_within(self, budget_s: float, paths: tuple[str, ...]) -> float:
        """The largest PSGS some path of ``paths`` samples and computes inside ``budget_s``
        (0.0: not even one node; inf: any size)."""
        best = 0.0
        hi = max(self.x_range[1], 1.0) * 64.0  # past the calibrated sizes, the lines alone
        compute = self.compute
        for p in paths:
            path = self.paths[p]
            a = path.fixed_s + compute.fixed_s
            b = path.per_seed_s + compute.per_seed_s
            line_x = float("inf") if b <= 0 else (budget_s - a) / b
            if not (path.has_points or compute.has_points):
                best = max(best, line_x)
                continue

            def predict_s(x: float, path: LatencyModel = path) -> float:
                return path.predict_s(x) + self.compute.predict_s(x)

            if predict_s(1.0) > budget_s:
                continue
            if line_x == float("inf") and predict_s(hi) <= budget_s:
                return line_x
            best = max(best, largest_within(predict_s, budget_s, 1.0, max(hi, min(line_x, 1e12)),
                                            path.sizes + compute.sizes))
        return best

    # ---- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": COST_VERSION, "key": self.key, "hop_s": self.hop_s,
                "x_range": list(self.x_range),
                "paths": {p: [m.fixed_s, m.per_seed_s] for p, m in self.paths.items()},
                "compute": [self.compute.fixed_s, self.compute.per_seed_s],
                "points": {k: [list(pt) for pt in v] for k, v in self.points.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        x_range = d.get("x_range") or (10.0, 10_000.0)
        model = cls({p: (float(v[0]), float(v[1])) for p, v in d["paths"].items() if p in PATHS},
                    (float(d["compute"][0]), float(d["compute"][1])), d.get("key"),
                    float(d.get("hop_s", PRIORS["cpu"][0])), (float(x_range[0]), float(x_range[1])),
                    {k: [(float(x), float(y)) for x, y in v] for k, v in d.get("points", {}).items()
                     if k in PATHS or k == "compute"})
        model.calibrated = True
        return model

    def save(self, path: Path) -> None:
        """Write as JSON (atomically)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: dict) -> CostModel | None:
        """The saved model when the file exists and its key equals ``key``, else None."""
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if d.get("version") != COST_VERSION or d.get("key") != key:
            return None
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, ValueError, IndexError):
            return None


def cost_key(graph_key: str, fanouts: list[int], device: str, extra: dict | None = None) -> dict:
    """What a calibration holds for: graph, fanouts and hardware (device name, CPU count, torch
    version), plus ``extra`` (GPU memory mode, model, samplers: they change the lines too)."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") \
        else f"cpu:{platform.machine()}"
    return {"graph": graph_key, "fanouts": list(fanouts), "device": name,
            "cpus": os.cpu_count(), "torch": torch.__version__, **(extra or {})}


def cost_path(key: dict) -> Path:
    """``$QUIVER_SERVE_CACHE/costs/cost-<hash of key>.json``."""
    from quiver_serve.routing.psgs import cache_dir

    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return cache_dir().parent / "costs" / f"cost-{digest}.json"
