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

A slow link (``assess_links``): each report also carries, per rank, the median time that rank's lane spent inside
the steps' collectives (``Pace.lane_wait_s``). In a collective the member that arrives last waits least, and the
others wait for it. A replica whose link on lane ``k`` is slow arrives last on that lane only, so in every other
replica lane ``k`` waits longer than their other lanes, in the same steps (one report), while in it lane ``k`` does
not stand out. A slow replica, or a slow rank (its siblings wait for it inside the replica, in FSDP2's collectives),
arrives late on every lane alike: no lane stands out, and it is a straggler, not a slow link. Comparing lanes within
one report needs no two replicas' windows of steps to line up (their reports reach the lighthouse at different
steps; compared across replicas, a slowdown's first steps looked like a slow link).
"""

from __future__ import annotations

import functools
import math
import statistics
import struct
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
MAX_LANES = 1 << 14
"""A report with more lane times than this (a replica of more ranks) is malformed: they travel as two bytes each
(``pack_lanes``), 32 KiB at most, well inside a heartbeat's 64 KiB."""


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
    lane_wait_s: tuple[float, ...] = ()
    """Per rank, the median time its lane spent inside the steps' collectives (empty: not measured)."""

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


def pack_lanes(seconds: Sequence[float]) -> bytes:
    """Lane times as they travel: milliseconds, little-endian uint16 each (rounded, at most 65,535)."""
    return struct.pack(f"<{len(seconds)}H", *(min(65_535, max(0, round(x * 1e3))) for x in seconds))


def unpack_lanes(data: bytes) -> tuple[float, ...] | None:
    """``pack_lanes``'s lane times in seconds; None when malformed (an odd length, more than ``MAX_LANES``)."""
    if len(data) % 2 or len(data) > 2 * MAX_LANES:
        return None
    return tuple(x / 1e3 for x in struct.unpack(f"<{len(data) // 2}H", data))


def valid_seconds(x: float) -> bool:
    """Whether a reported time is finite, non-negative and not absurd (at most ``MAX_SECONDS``)."""
    return math.isfinite(x) and 0.0 <= x <= MAX_SECONDS


def valid(pace: Pace) -> bool:
    """Whether a reported pace is well formed: a step, and ``valid_seconds`` times."""
    return pace.step >= 0 and valid_seconds(pace.compute_s) and valid_seconds(pace.wait_s) and \
        0 <= pace.busiest_rank < MAX_RANKS and valid_seconds(pace.busiest_s) and valid_seconds(pace.siblings_busy_s) \
        and len(pace.lane_wait_s) <= MAX_LANES and all(valid_seconds(x) for x in pace.lane_wait_s)


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


@dataclass(frozen=True)
class SlowLink:
    """A replica's lane the others wait for while its compute is on time, with the evidence."""

    replica_id: str
    rank: int
    """The rank whose lane is slow (lane ``rank`` joins rank ``rank`` of every replica)."""
    own_wait_s: float
    """Its lane's median time inside the steps' collectives (it arrives last: little)."""
    others_wait_s: float
    """How much longer the other replicas' same lane waits than their other lanes (the median of theirs): what the
    slow link costs each of them per step."""
    since_step: int
    """The first step of the reports that show it."""
    reports: int
    """How many reports of each of the others show it (``confirm``)."""

    def text(self) -> str:
        return (f"{self.replica_id} rank {self.rank}'s link is slow since step {self.since_step}: the other replicas' "
                f"rank {self.rank} wait {self.others_wait_s:.3f}s more per step in the exchange than their other "
                f"ranks (it waits {self.own_wait_s:.3f}s there)")


@functools.lru_cache(maxsize=1024)
def _others_medians(lanes: tuple[float, ...]) -> tuple[float, ...]:
    """Per lane, the median of the other lanes: from one sort (``/status`` asks for every lane of every report; a
    median per lane would be quadratic in the replica's ranks)."""
    n, order = len(lanes), sorted(range(len(lanes)), key=lanes.__getitem__)
    vals, rest = [lanes[k] for k in order], len(lanes) - 1
    out = [0.0] * n

    def kth(j: int, skip: int) -> float:  # the j-th smallest once position ``skip`` is left out
        return vals[j] if j < skip else vals[j + 1]

    for pos, k in enumerate(order):
        mid = rest // 2
        out[k] = kth(mid, pos) if rest % 2 else (kth(mid - 1, pos) + kth(mid, pos)) / 2
    return tuple(out)


def _stands_out(pace: Pace, lane: int) -> float:
    """How much longer ``lane`` waited inside the collectives than the median of the replica's other lanes."""
    return pace.lane_wait_s[lane] - _others_medians(pace.lane_wait_s)[lane]


def assess_links(histories: Mapping[str, Sequence[Pace]], confirm: int) -> tuple[SlowLink, ...]:
    """The slow links among the members whose reports are in ``histories`` (as for ``assess``). Each member's
    lanes are compared with each other, in the same steps (one report's medians): lane ``k`` of replica X is slow
    when, in each of the last ``confirm`` reports of every other member, their lane ``k`` waited at least
    ``MIN_EXCESS_S`` longer than the median of their other lanes, and in X's latest it did not. A slow replica or a
    slow rank (its siblings wait for it inside the replica) makes every lane of it late alike, so no lane stands
    out. Needs at least two members with at least two lanes (a one-rank replica's link and compute look alike)."""
    if confirm < 1:
        raise ValueError(f"need confirm >= 1, got {confirm}")
    lanes = {len(h[-1].lane_wait_s) for h in histories.values() if h}
    if len(histories) < 2 or len(lanes) != 1 or (n := lanes.pop()) < 2:
        return ()
    if any(len(p.lane_wait_s) != n for h in histories.values() for p in h[-confirm:]):
        return ()
    out: list[SlowLink] = []
    for k in range(n):
        waiting = {rid: h[-confirm:] for rid, h in histories.items()
                   if len(h) >= confirm and all(_stands_out(p, k) >= MIN_EXCESS_S for p in h[-confirm:])}
        quiet = [rid for rid, h in histories.items()
                 if rid not in waiting and h and _stands_out(h[-1], k) < MIN_EXCESS_S]
        if len(quiet) == 1 and len(waiting) == len(histories) - 1:
            extra = statistics.median(_stands_out(h[-1], k) for h in waiting.values())
            out.append(SlowLink(quiet[0], k, round(histories[quiet[0]][-1].lane_wait_s[k], 4), round(extra, 4),
                                min(h[0].step for h in waiting.values()), confirm))
    return tuple(sorted(out, key=lambda x: (-x.others_wait_s, x.replica_id, x.rank)))


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
