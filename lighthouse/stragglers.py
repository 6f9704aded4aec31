"""Fail-slow evidence: which replica the others wait on (docs/design.md §4, "Stragglers").

In synchronous HSDP one slow replica sets the pace: every exchange waits for its buckets. Rank 0 of each replica
reports with its heartbeats a ``Pace``: over its last ``PACE_WINDOW`` committed steps (failure-free ones, where it
contributed), the median of its compute time (forward and backward, until its last bucket was handed to FTAR)
and of its exchange wait (from there until its step's last bucket came back). The slow replica computes longer
and waits least; the others wait about its excess. Medians make one slow step (a page fault, a checkpoint, the
first step after a rejoin) count for nothing.

The lighthouse keeps each member's last ``KEEP`` reports of distinct steps (``remember``); ``assess`` — a pure
function of those histories — names a replica a straggler when its reported compute was at least ``factor`` times
the others' (the median of their latest reports) and at least ``MIN_EXCESS_S`` longer in each of its last
``confirm`` reports, and the others do wait on it (their median wait is at least ``WAIT_SHARE`` of its excess). A
flag that does not hold for ``confirm`` reports in a row is no flag: one noisy window raises nothing. What the
lighthouse does with a straggler is its policy: ``report`` (the status, the page and ``fthsdp status`` name it with
its evidence) or ``eject`` (``lighthouse.ejection``).

Inside the straggler, the rank: each report also carries the replica's busiest rank in the steps' compute, the
median of its busy time and that of the median of its siblings' (every rank's rides the replica's vote,
``fthsdp.runtime.commit.Tally``). The siblings of a slow rank wait for it in their collectives and burn nothing
meanwhile, so a rank busy ``factor`` times its siblings (and ``MIN_EXCESS_S`` more) in each of the straggler's
last ``confirm`` reports is where the slowness comes from, and the straggler names it (``Pace.slow_rank``); ranks
alike (a slow host) name none.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lighthouse.model import ACTIVE, State

PACE_WINDOW = 7
"""Committed steps a replica's report is the median of (4 slow steps in 7 move it)."""
KEEP = 8
"""Reports of distinct steps the lighthouse keeps per member."""
WAIT_SHARE = 0.25
"""The others' median exchange wait must be at least this share of a straggler's excess compute: a replica that
computes longer while nobody waits for it (its buckets are not the last) costs nothing."""
MIN_EXCESS_S = 0.05
"""A replica's compute must exceed the others' by at least this, not only by ``factor``, to count as slow: on steps
of tens of milliseconds a busy host's jitter makes one replica 1.5-1.8x "slower" by 10-30 ms for many steps, which
costs the others at most that per step. A straggler worth naming (a thermal-throttled GPU, a bad host) is slower by
a share of a real step, far more."""
MAX_SECONDS = 86_400.0
"""A reported time above this (or negative, or not finite) is malformed."""
MAX_RANKS = 1 << 20
"""A reported rank at or above this is malformed."""


@dataclass(frozen=True)
class Pace:
    """One replica's report: the medians over its last ``PACE_WINDOW`` committed steps, ending at ``step``."""

    step: int
    compute_s: float
    wait_s: float
    busiest_rank: int = 0
    busiest_s: float = 0.0
    siblings_busy_s: float = 0.0
    """The rank of the replica busiest in the steps' compute (on CPU, its process's CPU time: a rank that waits in
    a collective for a sibling burns none), the median of its busy time and of its siblings' (the median of the
    others' each step; 0: none)."""

    def slow_rank(self, factor: float) -> int | None:
        """The rank the replica's slowness comes from: its busy time is at least ``factor`` times its siblings' and
        ``MIN_EXCESS_S`` more; None when its ranks are alike (or it has one)."""
        if self.busiest_s >= factor * self.siblings_busy_s and self.busiest_s - self.siblings_busy_s >= MIN_EXCESS_S:
            return self.busiest_rank
        return None


@dataclass(frozen=True)
class Straggler:
    """A replica the others wait on, with the evidence."""

    replica_id: str
    slowdown: float
    """Its latest compute over the others' median (2.0: it takes twice as long)."""
    others_wait_s: float
    """The others' median exchange wait per step: what it costs each of them."""
    since_step: int
    """The step of the first report of its current run of slow ones."""
    reports: int
    """Reports in that run (at least ``confirm``)."""
    rank: int | None = None
    """The rank of it the slowness comes from (``Pace.slow_rank``); None: its ranks are alike."""
    rank_busy_ratio: float = 0.0
    """That rank's busy time over its siblings'."""

    def text(self) -> str:
        where = "" if self.rank is None else \
            f" (rank {self.rank}: {self.rank_busy_ratio:.2f}x its siblings' compute)"
        return (f"{self.replica_id}{where} is {self.slowdown:.2f}x slower than the others since step "
                f"{self.since_step}; they wait {self.others_wait_s:.3f}s per step on it")


def valid_seconds(x: float) -> bool:
    """Whether a reported time is finite, non-negative and not absurd (at most ``MAX_SECONDS``)."""
    return math.isfinite(x) and 0.0 <= x <= MAX_SECONDS


def valid(pace: Pace) -> bool:
    """Whether a reported pace is well formed: a step, and ``valid_seconds`` times."""
    return pace.step >= 0 and valid_seconds(pace.compute_s) and valid_seconds(pace.wait_s) and \
        0 <= pace.busiest_rank < MAX_RANKS and valid_seconds(pace.busiest_s) and valid_seconds(pace.siblings_busy_s)


def remember(history: tuple[Pace, ...], pace: Pace, keep: int = KEEP) -> tuple[Pace, ...]:
    """``history`` with ``pace`` added when it is of a newer step than the last one (a heartbeat repeats the latest
    report until the next step), at most ``keep`` of them; a report of an older step (a new incarnation counts
    from where the job is, never lower) starts a new history."""
    if history and pace.step == history[-1].step:
        return history
    if history and pace.step < history[-1].step:
        return (pace,)
    return (*history, pace)[-keep:]


def assess(histories: Mapping[str, Sequence[Pace]], factor: float, confirm: int) -> tuple[Straggler, ...]:
    """The stragglers among the members whose reports are in ``histories`` (the caller passes only the current
    incarnations of the members that train), slowest first. Needs at least two members with reports."""
    if factor <= 1.0 or confirm < 1:
        raise ValueError(f"need factor > 1 and confirm >= 1, got {factor} and {confirm}")
    latest = {rid: h[-1] for rid, h in histories.items() if h}
    if len(latest) < 2:
        return ()
    out: list[Straggler] = []
    for rid, history in histories.items():
        if len(history) < confirm:
            continue
        others = [p for r, p in latest.items() if r != rid]
        base = statistics.median(p.compute_s for p in others)
        waited = statistics.median(p.wait_s for p in others)
        if base <= 0.0:
            continue
        run = 0
        for p in reversed(history):
            if p.compute_s < factor * base or p.compute_s - base < MIN_EXCESS_S:
                break
            run += 1
        mine = history[-1]
        if run >= confirm and waited >= WAIT_SHARE * (mine.compute_s - base):
            ranks = {p.slow_rank(factor) for p in history[-confirm:]}  # one rank, in each of the last reports
            rank = ranks.pop() if len(ranks) == 1 else None
            out.append(Straggler(rid, round(mine.compute_s / base, 3), round(waited, 4), history[-run].step, run,
                                 rank, round(mine.busiest_s / max(mine.siblings_busy_s, 1e-3), 3) if rank is not None
                                 else 0.0))
    return tuple(sorted(out, key=lambda s: (-s.slowdown, s.replica_id)))


def training_paces(state: State, paces: Mapping[str, tuple[str, tuple[Pace, ...]]]) -> dict[str, tuple[Pace, ...]]:
    """The histories ``assess`` looks at: those of the current incarnations of the active members of the epoch
    (a joiner exchanges zeros; an earlier incarnation's reports are not its successor's)."""
    epoch = state.epoch
    if epoch is None:
        return {}
    out = {}
    for x in epoch.members:
        inc, history = paces.get(x.replica_id, ("", ()))
        member = state.members.get(x.replica_id)
        if history and member is not None and member.role == ACTIVE and member.incarnation == inc == x.incarnation:
            out[x.replica_id] = history
    return out
