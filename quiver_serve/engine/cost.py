"""A measured latency model per path: seconds as a line in the batch's seed count.

The engine core feeds it every batch it finishes (seeds, seconds) and asks it two things: how many
seeds a batch may take and still finish inside the oldest request's remaining deadline budget, and
when the batch now on the GPU is expected to finish (so the next one is formed as late as possible,
with as many requests as possible, but still in time to keep the GPU busy). The routing issue
replaces the seed count with the predicted sampled-graph size (PSGS) and calibrates at start-up.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class LatencyModel:
    """Least-squares line ``latency_s = fixed_s + per_seed_s * seeds`` over a sliding window."""

    def __init__(self, window: int = 128, prior_fixed_s: float = 1e-3,
                 prior_per_seed_s: float = 1e-6) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self.fixed_s = prior_fixed_s
        self.per_seed_s = prior_per_seed_s
        self._since_fit = 0

    def observe(self, seeds: int, seconds: float) -> None:
        self._points.append((float(seeds), float(seconds)))
        self._since_fit += 1
        if self._since_fit >= 8 or len(self._points) < 8:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        pts = np.asarray(self._points)
        x, y = pts[:, 0], pts[:, 1]
        if len(pts) < 2 or np.ptp(x) == 0:  # one size seen: scale the fixed term only
            self.fixed_s = max(float(np.median(y)) - self.per_seed_s * float(x.mean()), 0.0)
            return
        slope, intercept = np.polyfit(x, y, 1)
        self.per_seed_s = max(float(slope), 0.0)
        self.fixed_s = max(float(intercept), 0.0)

    def predict_s(self, seeds: int) -> float:
        return self.fixed_s + self.per_seed_s * seeds

    def max_seeds_within(self, budget_s: float, cap: int) -> int:
        """The most seeds (at least 1, at most ``cap``) predicted to finish inside ``budget_s``."""
        if self.per_seed_s <= 0:
            return cap
        n = int((budget_s - self.fixed_s) / self.per_seed_s)
        return max(1, min(cap, n))
