"""Expected fill: when the engine core forms a batch that is smaller than the traffic suggests.

Continuous batching forms a batch from whatever waits the moment the engine can take one. With
callers that come back together (a closed loop of workers, a burst) that splits them into two
groups whose batches alternate: each request then waits for the other group's batch and its own,
about twice the batch time, and each batch holds half the requests (on a GPU, where a batch's time
grows far slower than its size, half the throughput). So a batch that would hold well under what
is usually in the system (the ids of the batch last answered plus those the engine then held:
waiting, sampling or computing; or, if more, what the clients report they have outstanding) waits
a moment for the rest, even past the end of the batch on the
GPU (so two groups of callers merge into one):

* the device idles at most the fixed cost of one batch (what merging two batches into one saves:
  with ``T(n) = a + b n``, ``2 T(n) - T(2 n) = a``), ``max_wait_s`` at most; waiting while a batch
  still computes costs nothing and is not counted; never past the deadline slack. It is formed
  as soon as ``fraction`` (98%) of the expected ids wait, or 75% once arrivals have paused for
  ``quiet_s`` or 5% of the batch's fixed cost, whichever is longer (a group's last stragglers would
  otherwise each wait a whole extra batch). The
  engine loop sleeps in its poll meanwhile (an arrival wakes it), so the callers it waits for
  get the CPU;
* the wait is kept only while it pays: a hold that times out short of the target is a miss (with
  open-loop arrivals the ids never come back at once), and after a run of misses the policy
  expects only the recent batch size (no wait under steady arrivals) and probes again now and then.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpectedFill:
    fraction: float = 0.98
    #: ... or this fraction once arrivals have paused for ``quiet_s`` (the last stragglers
    #: of a group would otherwise each wait a whole extra batch)
    settled_fraction: float = 0.75
    quiet_s: float = 3e-4
    quiet_share: float = 0.05  # ... or this share of a batch's fixed cost, if longer
    max_wait_s: float = 5e-3
    ewma: float = 0.2
    #: the hit rate under which only the recent batch size is expected, and its climb per batch
    min_hit_rate: float = 0.5
    probe_step: float = 0.01

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.recent_ids = 0.0  # formed batches
        self.system_ids = 0.0  # batch answered + ids the engine then held
        self.hit_rate = 1.0
        self._hold_since_s: float | None = None

    @property
    def holding(self) -> bool:
        return self._hold_since_s is not None

    def target_ids(self, cap: int) -> float:
        usual = self.recent_ids
        if self.hit_rate >= self.min_hit_rate:
            usual = max(usual, self.system_ids)
        return self.fraction * min(usual, cap)

    def ready(self, waiting_ids: int, cap: int, now_s: float, saving_s: float,
              slack_s: float, device_busy: bool = False, last_arrival_s: float = 0.0) -> bool:
        """Form now? ``saving_s``: a batch's fixed cost (what a merge saves); ``slack_s``: the
        oldest request's deadline minus the target batch's predicted time; ``device_busy``: a
        batch still computes (waiting then costs no idle time: the hold's clock starts when it
        ends); ``last_arrival_s``: when the newest waiting micro-batch arrived."""
        target = self.target_ids(cap)
        quiet_s = max(self.quiet_s, self.quiet_share * saving_s)  # stragglers of a long batch
        settled = waiting_ids >= target * self.settled_fraction / self.fraction \
            and now_s - last_arrival_s >= quiet_s
        if waiting_ids >= target or settled:
            self._end_hold(hit=True)
            return True
        if device_busy and slack_s > 0:
            return False
        if self._hold_since_s is None:
            self._hold_since_s = now_s
        if now_s - self._hold_since_s >= min(self.max_wait_s, saving_s, slack_s):
            self._end_hold(hit=False)
            return True
        return False

    def release(self) -> None:
        """Form now for another reason (a seeded request forms alone): no hit, no miss."""
        self._hold_since_s = None

    def on_formed(self, ids: int) -> None:
        self.recent_ids = self._avg(self.recent_ids, ids)
        if self.hit_rate < self.min_hit_rate:
            self.hit_rate += self.probe_step  # try again now and then: traffic changes

    def on_answered(self, batch_ids: int, held_ids: int, reported_ids: int = 0) -> None:
        """``reported_ids``: what the clients say they have outstanding (their callers between
        two requests included, which the engine cannot see)."""
        self.system_ids = self._avg(self.system_ids, max(batch_ids + held_ids, reported_ids))

    def _end_hold(self, hit: bool) -> None:
        if self._hold_since_s is not None:
            self.hit_rate += self.ewma * (float(hit) - self.hit_rate)
            self._hold_since_s = None

    def _avg(self, avg: float, value: int) -> float:
        return avg + self.ewma * (value - avg) if avg else float(value)
