"""What each replica was doing over a run, as intervals a person reads at a glance (the demo's timeline): pure, from
the launcher's events and the replicas' progress rows.

States: ``starting`` (its process started: torchrun, imports, registration, until its first step or its joining),
``joining`` (catching up: it exchanges zeros and trains nothing, until the step it joined and the zero step after
it), ``training``, and ``down`` (from its exit until the launcher restarted it, or the end of the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fthsdp.launch.progress import ProgressRow

STATES = ("starting", "joining", "training", "down")


def lanes(rows: Sequence[ProgressRow], events: Sequence[dict[str, Any]], replica: int,
          t_end: float) -> list[tuple[str, float, float]]:
    """``(state, from, to)`` intervals of replica ``replica``, in time order, up to ``t_end``: one per stretch
    of one state. ``events`` are the launcher's (``start`` and ``exit``, with ``t`` and ``replica``)."""
    marks: list[tuple[float, str]] = []
    for e in events:
        if e.get("replica") != replica:
            continue
        if e["event"] == "start":
            marks.append((e["t"], "starting"))
        elif e["event"] == "exit":
            marks.append((e["t"], "down"))
        elif e["event"] in ("finished", "terminated"):
            marks.append((e["t"], "end"))
    for x in rows:
        if x.event == "step":
            marks.append((x.t, "training" if x.contributed and not x.joined else "joining"))
        elif x.event == "start" and x.joining:
            marks.append((x.t, "joining"))
    marks.sort(key=lambda m: m[0])
    out: list[tuple[str, float, float]] = []
    state: str | None = None
    since = 0.0
    for t, s in marks:
        if state == "down" and s not in ("starting", "end"):
            continue  # rows of the incarnation that died, written as it went down
        if s == state:
            continue
        if state is not None and state != "end" and t > since:
            out.append((state, since, t))
        state, since = s, t
    if state is not None and state != "end" and t_end > since:
        out.append((state, since, t_end))
    return out
