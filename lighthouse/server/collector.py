"""When the lighthouse lets Python's cyclic garbage collector pause it (docs/design.md §4, *Costs that stay
O(change)*).

A lighthouse of thousands of replica groups holds hundreds of thousands of long-lived objects (each session's
tasks and gRPC call, the members, the epoch history). CPython's full collection walks them all: 100-300 ms at
5,000 groups, landing in the middle of an epoch's push (measured: one or two such pauses per death's push, a
quarter of its time). So the lighthouse moves what exists out of the collector's sight at every liveness tick
(``gc.freeze``: O(1)); the collector then only walks objects younger than a tick. Cyclic garbage among frozen
objects (a closed session's task, say) waits for a full collection, which runs when the job has been quiet for a
while (no epoch change), at most every ``FULL_EVERY_S``, and in any case every ``2 * FULL_EVERY_S``.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("fthsdp.lighthouse")

FULL_EVERY_S = 300.0
"""A full collection (everything unfrozen first) at most this often, when quiet; at least every twice this."""
QUIET_S = 5.0
"""Seconds without an epoch change before a full collection may run."""


def full_due(now: float, last_change: float, last_full: float, every_s: float = FULL_EVERY_S,
             quiet_s: float = QUIET_S) -> bool:
    """Whether to run a full collection now: one is due (``every_s`` since the last) and the job has been quiet for
    ``quiet_s``, or it is long overdue (twice ``every_s``: a job that is never quiet still gets its garbage back)."""
    since = now - last_full
    return since >= 2 * every_s or (since >= every_s and now - last_change >= quiet_s)


class Collector:
    """The lighthouse's collection policy; ``tick`` runs with each liveness tick, on the event loop."""

    def __init__(self, now: float) -> None:
        self.last_full = now

    def tick(self, now: float, last_change: float) -> None:
        """Freeze what exists (O(1)); first, when ``full_due``, collect everything (one pause, off the pushes)."""
        if full_due(now, last_change, self.last_full):
            t0 = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            self.last_full = now
            log.info("lighthouse full garbage collection: %d objects freed in %.0f ms", found,
                     1e3 * (time.perf_counter() - t0))
        gc.freeze()
