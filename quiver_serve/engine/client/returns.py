"""ReturnGate: callers blocked on their answers that are answered together send their next
requests together.

A thread blocked in ``Pipeline.embed`` that gets its answer usually asks again at once (a worker
in a closed loop). When one reply answers many such threads they come back one at a time, each
scheduled and taking the GIL in turn, so the last is back well after the first (milliseconds on
a small box). Waking the IO thread on each would split the next round into many micro-batches:
the IO thread competes with the returning callers for the GIL, the engine core starts a small
batch on the first few, and a round answered in pieces comes back in pieces again.

So the IO-thread client counts, of the blocking callers it answers, those expected back
(``answered``): a thread whose last request came within ``quiet_s`` of its previous answer
(``EngineClient.call`` notes it per thread; a thread with think time between its requests is
never waited for). Requests then wait in the inbox, and no submit wakes the IO thread, until as
many wait as were expected (``wake_now``, checked by each submit), and leave in one tick
(``release``). Should some not come back, the IO thread, looking every ``quiet_s`` (its poll
timeout), lets the waiting ones go once none came back since it last looked, or ``max_hold_s``
after the last answer. A single caller is never held (one answered, one back). The hold is kept
only while it pays: a hold that ends short of the count is a miss (callers that wait for each
other, say); under ``min_hit_rate`` (an EWMA) nothing is held, and each tick that sends without
a hold raises the rate by ``probe_step``, so holding is tried again now and then.

Only the IO-thread client uses it; plain in-memory bookkeeping, tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReturnGate:
    #: a hold ends when no answered caller came back for this long (the IO thread looks then)
    quiet_s: float = 0.001
    #: ... or this long after the last answer, whatever still comes back
    max_hold_s: float = 0.010
    ewma: float = 0.2
    #: the hit rate under which nothing is held, and its climb per tick sent without a hold
    min_hit_rate: float = 0.5
    probe_step: float = 0.01

    def __post_init__(self) -> None:
        #: blocking callers answered whose next request is not yet counted
        self.expected = 0
        self.seen = 0  # requests waiting when the IO thread last looked
        self.last_s = 0.0  # monotonic: the last answer, or the last look that found more
        self.until_s = 0.0  # monotonic: the hold's end at the latest
        self.hit_rate = 1.0
        self.holds = self.hits = 0  # holds opened and filled (observability)

    def answered(self, count: int, now_s: float) -> None:
        """The IO thread answered ``count`` blocking callers that are expected back."""
        if count <= 0 or self.hit_rate < self.min_hit_rate:
            return
        if self.expected == 0:
            self.holds += 1
            self.seen = 0
        self.expected += count
        self.last_s = now_s
        self.until_s = now_s + self.max_hold_s

    def wake_now(self, waiting: int) -> bool:
        """Whether a submit that leaves ``waiting`` requests in the inbox wakes the IO thread."""
        return waiting >= self.expected

    def wait_s(self, now_s: float) -> float | None:
        """How long the IO thread may sleep before it looks again (None: no hold)."""
        if not self.expected:
            return None
        return max(min(self.last_s + self.quiet_s, self.until_s) - now_s, 0.0)

    def release(self, waiting: int, now_s: float) -> bool:
        """Whether the ``waiting`` requests leave now (IO thread, each tick)."""
        if self.expected == 0:
            if waiting and self.hit_rate < 1.0:
                self.hit_rate = min(1.0, self.hit_rate + self.probe_step)
            return waiting > 0
        if waiting >= self.expected:
            self._score(True)
            return True
        if waiting > self.seen:  # still coming back
            self.seen, self.last_s = waiting, now_s
        if now_s < min(self.last_s + self.quiet_s, self.until_s):
            return False
        self._score(False)
        return waiting > 0

    def _score(self, hit: bool) -> None:
        self.expected = 0
        self.hits += hit
        self.hit_rate += self.ewma * (float(hit) - self.hit_rate)
