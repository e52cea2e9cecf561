"""QuietGate: when background device work may take the engine's device and interpreter
(docs/architecture.md, "The exact table", refresh; docs/decisions/0068-quiet-gate.md).

The engine loop notes after every step whether it is quiet: no request waiting, no batch
sampling, sampled or in flight (requests parked for a graph version or waiting for the table's
round do not count: background work is what they wait for). Background work that competes with serving for the device, the host's
memory bandwidth and the interpreter lock (the exact table's refresh chunks on their thread, a new
model version's table build between steps) runs a chunk when the loop is quiet, so a serving batch
meets at most the chunk that was running when its request came. Under a load that never leaves
the loop quiet, a chunk that has waited ``max_wait_s`` runs anyway: the work still progresses, at
a share of the time the wait bounds, and what it keeps stale is answered on the fly meanwhile.
"""

from __future__ import annotations

import threading
import time


class QuietGate:
    """The loop's quiet flag, and the waits of background work on it (see the module)."""

    def __init__(self, max_wait_s: float) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = float(max_wait_s)
        self._quiet = threading.Event()
        self._quiet.set()  # until the loop's first step says otherwise
        #: chunks that ran at a quiet loop, and those that ran after waiting ``max_wait_s``
        self.quiet_turns = 0
        self.waited_turns = 0

    def note(self, quiet: bool) -> None:
        """The loop thread, after each step (an Event's lock is taken only on a change)."""
        if quiet != self._quiet.is_set():
            if quiet:
                self._quiet.set()
            else:
                self._quiet.clear()

    def wait_turn(self, stop: threading.Event | None = None) -> bool:
        """Another thread, before a chunk: block until the loop is quiet, or ``max_wait_s``
        has passed (or ``stop`` is set, checked every 50 ms). True: the loop was quiet."""
        deadline_s = time.monotonic() + self.max_wait_s
        while True:
            left_s = deadline_s - time.monotonic()
            if self._quiet.wait(max(0.0, min(left_s, 0.05))):
                self.quiet_turns += 1
                return True
            if left_s <= 0 or (stop is not None and stop.is_set()):
                self.waited_turns += 1
                return False

    def due(self, quiet: bool, last_turn_s: float, now_s: float) -> bool:
        """The loop thread's own background work (a table build between steps), given whether
        the loop is ``quiet`` now: run if so, or if the last turn was ``max_wait_s`` ago
        (``time.monotonic`` s)."""
        if quiet:
            self.quiet_turns += 1
            return True
        if now_s - last_turn_s >= self.max_wait_s:
            self.waited_turns += 1
            return True
        return False


def open_gate() -> QuietGate:
    """A gate that never holds anything back (tables without an engine loop: tests, tools)."""
    return QuietGate(0.0)
