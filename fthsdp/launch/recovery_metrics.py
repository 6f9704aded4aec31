"""Recovery metrics from progress rows: the numbers of ``fthsdp demo``'s report and of ``fthsdp bench recovery``
(fthsdp, torchft and the whole-job restart baseline are all measured with these functions).

Inputs, per replica index: its ``step`` progress rows (``fthsdp.launch.progress.ProgressRow``: ``step``, ``t``
in ``time.time()`` seconds, ``incarnation``, ``joined``; one per committed step), and the failures (``Failure``: the
time the launcher saw the replica group exit, or the time it killed it).

Definitions:

- ``median_step_s``: the median gap between two consecutive committed steps of one incarnation of one replica,
  over gaps that end at a step ``>= warmup`` (gaps around a failure are in it; the median is robust to them).
- ``survivor_max_stall_s``: over the replicas that never failed, the longest gap between two of their commits
  less the median step (the demo's historical figure).
- ``stall_per_failure_s``: for each failure, over the replicas that never failed, the longest gap that ends
  after the failure and starts before the next one, less the median step.
- ``lost_per_failure_s``: for each failure, over the survivors, the sum of (gap - median) over the gaps in that
  window longer than ``stall_factor`` x the median (catches a second stall when the failed replica rejoins).
- ``rejoin_s``: from each failure to the failed replica's first committed step after it (the step it joined
  in; rows marked ``joined``, or with ``require_joined=False`` any row of a later incarnation).
- ``effective_training_time``: what the job trained x the median step, over replicas x the wall time from the
  first to the last commit. What it trained is counted in data: the distinct (slot, batch) pairs its committed
  steps report (``batches``: every batch of every slot once, whoever trained it: a spare, or one day a holder
  carrying another slot's batches; ``ett_basis`` "batches"). Where the rows report no batches (the baselines'
  trainers), in replica-steps: distinct (replica, step) pairs trained (joined steps, and fthsdp's zero step after
  them, excluded; a step trained again after a restart counts once; ``ett_basis`` "replica-steps"). The two agree
  while every contributing replica trains one batch of one slot per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from fthsdp.launch.progress import ProgressRow

WARMUP_STEPS = 5
"""Steps the benchmarks exclude from the steady-state medians (the reference workload's definition)."""

Steps = Mapping[int, Sequence[ProgressRow]]
"""Replica index -> its committed-step rows."""


@dataclass(frozen=True)
class Failure:
    """A replica group's failure at time ``t`` (``time.time()``); ``incarnation``: the one that died, when known."""

    t: float
    replica: int
    incarnation: str | int | None = None


def _same_incarnation_gaps(rows: Sequence[ProgressRow], warmup: int) -> list[tuple[ProgressRow, ProgressRow]]:
    return [(a, b) for a, b in pairwise(rows) if a.incarnation == b.incarnation and (b.step or 0) >= warmup]


def median_step(steps: Steps, warmup: int = 0) -> float:
    gaps = [b.t - a.t for rows in steps.values() for a, b in _same_incarnation_gaps(rows, warmup)]
    return statistics.median(gaps) if gaps else 0.0


def recovery_metrics(steps: Steps, failures: Sequence[Failure], replicas: int, warmup: int = 0,
                     stall_factor: float = 1.5, require_joined: bool = True) -> dict[str, Any]:
    """The metrics above; ``steps`` maps every replica index to its step rows in commit order."""
    rows_by = {i: sorted(rows, key=lambda x: x.t) for i, rows in steps.items()}
    med = median_step(rows_by, warmup)
    fails = sorted(failures, key=lambda e: e.t)
    failed = {e.replica for e in fails}
    survivors = [i for i in rows_by if i not in failed]

    survivor_max = 0.0
    for i in survivors:
        for a, b in pairwise(rows_by[i]):
            survivor_max = max(survivor_max, b.t - a.t - med)

    stall, lost = [], []
    for n, e in enumerate(fails):
        end = fails[n + 1].t if n + 1 < len(fails) else float("inf")
        worst, worst_lost = 0.0, 0.0
        for i in survivors:
            gaps = [b.t - a.t for a, b in pairwise(rows_by[i]) if b.t > e.t and a.t < end]
            if gaps:
                worst = max(worst, max(gaps) - med)
            worst_lost = max(worst_lost, sum(g - med for g in gaps if g > stall_factor * med))
        stall.append(worst)
        lost.append(worst_lost)

    rejoin = []
    for e in fails:
        killed_inc = max((_incarnation(x) for x in rows_by.get(e.replica, []) if x.t <= e.t), default=None)
        later = [x for x in rows_by.get(e.replica, []) if x.t > e.t
                 and (x.joined if require_joined else _incarnation(x) != killed_inc)]
        if later:
            rejoin.append(later[0].t - e.t)

    all_rows = [x for rows in rows_by.values() for x in rows]
    t_first = min((x.t for x in all_rows), default=0.0)
    t_end = max((x.t for x in all_rows), default=0.0)
    trained = len({(i, x.step) for i, rows in rows_by.items() for x in rows if not x.joined and x.contributed})
    batches = {(s, b) for x in all_rows for s, b in (x.batches or ())}
    counted = len(batches) if batches else trained
    ett = counted * med / (replicas * (t_end - t_first)) if t_end > t_first else 0.0
    return {
        "median_step_s": med,
        "survivor_max_stall_s": survivor_max,
        "stall_per_failure_s": stall,
        "lost_per_failure_s": lost,
        "rejoin_per_failure_s": rejoin,
        "rejoin_s": max(rejoin) if rejoin else None,
        "effective_training_time": ett,
        "replica_steps_trained": trained,
        "batches_trained": len(batches),
        "trained": counted,
        "ett_basis": "batches" if batches else "replica-steps",
        "wall_s": t_end - t_first,
    }


def whole_job_restart_metrics(steps: Steps, failure: Failure, replicas: int, warmup: int = 0) -> dict[str, Any]:
    """A job that restarts every replica from its last checkpoint on a failure (one failure): ``resume_s`` is
    from the failure to the first step committed after the restart, ``lost_steps`` the steps committed before
    the failure that had to be trained again, and the stall is ``resume_s + lost_steps x median step`` (every
    replica stalls: there are no survivors)."""
    base = recovery_metrics(steps, [failure], replicas, warmup=warmup, require_joined=False)
    med = base["median_step_s"]
    before = [x.step for rows in steps.values() for x in rows if x.t <= failure.t and x.step is not None]
    # The baselines' incarnations count torchrun's restarts (1, 2, ...).
    dead = int(failure.incarnation if failure.incarnation is not None else max(
        (int(_incarnation(x)) for rows in steps.values() for x in rows if x.t <= failure.t), default=0))
    # Steps the other replicas committed after the kill but before the restart are not new progress.
    after = sorted((x for rows in steps.values() for x in rows if x.t > failure.t and int(_incarnation(x)) > dead),
                   key=lambda x: x.t)
    if not before or not after:
        raise ValueError("need committed steps before and after the failure")
    resume = after[0].t - failure.t
    restart_from = min(x.step for x in after if x.step is not None)
    lost = max(0, max(before) + 1 - restart_from)
    return {**base, "resume_s": resume, "lost_steps": lost, "restart_from_step": restart_from,
            "stall_per_failure_s": [resume + lost * med], "rejoin_per_failure_s": [resume], "rejoin_s": resume}


def _incarnation(x: ProgressRow) -> str | int:
    """A row's incarnation; 0 when it names none (plain FSDP2's rows)."""
    return x.incarnation if x.incarnation is not None else 0
