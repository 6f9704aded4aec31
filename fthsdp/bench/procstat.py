"""What the benchmarks read of a process and of a sample: CPU seconds from /proc, percentiles."""

from __future__ import annotations

import os
import pathlib


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (its /proc stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; NaN when there are none)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
