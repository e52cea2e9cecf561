"""A measured latency model per path: seconds as a line in the batch's seed count.

The engine core feeds it every batch it finishes (seeds, seconds) and asks it two things: how many
seeds a batch may take and still finish inside the oldest request's remaining deadline budget, and
when the batch now on the GPU is expected to finish (so the next one is formed as late as possible,
with as many requests as possible, but still in time to keep the GPU busy). The routing issue
replaces the seed count with the predicted sampled-graph size (PSGS) and calibrates at start-up.
"""

from __future__ import annotations

from collections import deque


class LatencyModel:
    """Least-squares line ``latency_s = fixed_s + per_seed_s * seeds`` over a sliding window
    (running sums: O(1) per batch on the serving path)."""

    def __init__(self, window: int = 128, prior_fixed_s: float = 1e-3,
                 prior_per_seed_s: float = 1e-6) -> None:
        self._points: deque[tuple[float, float]] = deque()
        self._window = window
        self._sums = [0.0, 0.0, 0.0, 0.0]  # x, y, xx, xy
        self.fixed_s = prior_fixed_s
        self.per_seed_s = prior_per_seed_s

    def observe(self, seeds: int, seconds: float) -> None:
        x, y = float(seeds), float(seconds)
        self._points.append((x, y))
        self._add(x, y, 1.0)
        if len(self._points) > self._window:
            self._add(*self._points.popleft(), -1.0)
        self._fit()

    def _add(self, x: float, y: float, sign: float) -> None:
        s = self._sums
        s[0] += sign * x
        s[1] += sign * y
        s[2] += sign * x * x
        s[3] += sign * x * y

    def _fit(self) -> None:
        n = len(self._points)
        sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / n, sy / n
        var_x = sxx / n - mean_x * mean_x
        if n < 2 or var_x <= 1e-9 * max(mean_x * mean_x, 1.0):
            # one size seen: scale the fixed term only
            self.fixed_s = max(mean_y - self.per_seed_s * mean_x, 0.0)
            return
        slope = max((sxy / n - mean_x * mean_y) / var_x, 0.0)
        self.per_seed_s = slope
        self.fixed_s = max(mean_y - slope * mean_x, 0.0)

    def predict_s(self, seeds: int) -> float:
        return self.fixed_s + self.per_seed_s * seeds

    def max_seeds_within(self, budget_s: float, cap: int) -> int:
        """The most seeds (at least 1, at most ``cap``) predicted to finish inside ``budget_s``."""
        if self.per_seed_s <= 0:
            return cap
        n = int((budget_s - self.fixed_s) / self.per_seed_s)
        return max(1, min(cap, n))
