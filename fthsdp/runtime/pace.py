"""This replica's pace, for the lighthouse's fail-slow evidence (``lighthouse.stragglers``): per committed step its
compute time (forward and backward, until its last bucket went to FTAR) and its exchange wait (from there until
the step's last bucket came back), summarised as medians over the last ``PACE_WINDOW`` steps; and, from every
rank's busy time in the step's compute (the replica's vote carries them: ``fthsdp.runtime.commit.Tally``), the
rank whose median over the window is highest, that median, and the median of the other ranks' medians. Medians
per rank first: siblings that jitter step to step do not make one of them look slow. Likewise every rank's lane's
median time inside the step's collectives (``Pace.lane_wait_s``), which the lighthouse compares lane by lane across
replicas to find a slow link (``lighthouse.stragglers.assess_links``).

Only steps that say something about speed count: committed at the first attempt (a failure's redo measures the
failure) with this replica contributing (a joiner's zero steps compute nothing)."""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence

from lighthouse.stragglers import PACE_WINDOW, Pace


class PaceWindow:
    """The last ``size`` steps' compute and wait times."""

    def __init__(self, size: int = PACE_WINDOW) -> None:
        self._steps: deque[tuple[int, float, float, tuple[int, ...], tuple[int, ...]]] = deque(maxlen=size)

    def add(self, step: int, compute_s: float, wait_s: float, busy_ms: tuple[int, ...] = (),
            lane_ms: tuple[int, ...] = ()) -> Pace | None:
        """Record a step (``busy_ms``: every rank's busy time in its compute, by rank; ``lane_ms``: every rank's
        lane's time inside the step's collectives; empty: not known); returns the report once the window is full
        (None before: too little to say)."""
        self._steps.append((step, max(0.0, compute_s), max(0.0, wait_s), busy_ms, lane_ms))
        if len(self._steps) < (self._steps.maxlen or 0):
            return None
        pace = Pace(step, statistics.median(x[1] for x in self._steps), statistics.median(x[2] for x in self._steps),
                    lane_wait_s=medians([x[4] for x in self._steps]))
        busy = medians([x[3] for x in self._steps])
        if len(busy) < 2:
            return pace  # one rank, or not known every step: no rank to name
        top = max(range(len(busy)), key=lambda k: (busy[k], k))
        return dataclasses.replace(pace, busiest_rank=top, busiest_s=busy[top],
                                   siblings_busy_s=statistics.median(m for k, m in enumerate(busy) if k != top))


def medians(rows: Sequence[tuple[int, ...]]) -> tuple[float, ...]:
    """Per rank, the median over ``rows`` (one per step: milliseconds, by rank), in seconds; empty when the rows do
    not all have the same number of ranks (not known every step) or have none."""
    sizes = {len(row) for row in rows}
    if len(sizes) != 1 or (n := sizes.pop()) < 1:
        return ()
    return tuple(statistics.median(row[k] for row in rows) / 1e3 for k in range(n))
