"""This replica's pace, for the lighthouse's fail-slow evidence (``lighthouse.stragglers``): per committed step its
compute time (forward and backward, until its last bucket went to FTAR) and its exchange wait (from there until
the step's last bucket came back), summarised as medians over the last ``PACE_WINDOW`` steps.

Only steps that say something about speed count: committed at the first attempt (a failure's redo measures the
failure) with this replica contributing (a joiner's zero steps compute nothing)."""

from __future__ import annotations

import statistics
from collections import deque

from lighthouse.stragglers import PACE_WINDOW, Pace


class PaceWindow:
    """The last ``size`` steps' compute and wait times."""

    def __init__(self, size: int = PACE_WINDOW) -> None:
        self._steps: deque[tuple[int, float, float]] = deque(maxlen=size)

    def add(self, step: int, compute_s: float, wait_s: float) -> Pace | None:
        """Record a step; returns the report once the window is full (None before: too little to say)."""
        self._steps.append((step, max(0.0, compute_s), max(0.0, wait_s)))
        if len(self._steps) < (self._steps.maxlen or 0):
            return None
        return Pace(step, statistics.median(c for _, c, _ in self._steps),
                    statistics.median(w for _, _, w in self._steps))
