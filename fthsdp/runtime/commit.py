"""The commit protocol of one step (docs/design.md §3), as a pure state machine: events in, decisions out.

A step's exchange is one FTAR all-reduce per bucket on this rank's lane. The runtime tells the machine what
became of each bucket (``lane``: exchanged in epoch E under the tag of step S, or failed, and why), takes this
rank's ``ballot``, runs the replica-local vote (one MAX all-reduce of the encoded ballots over the replica's
ranks) and hands the ``Tally`` back (``vote``). The decision:

- ``Commit``: every rank exchanged every bucket, all in one epoch, for the same step: apply the step.
- ``Redo``: the vote failed: every lane redoes the exchange, in bucket order, under the next epoch from the same
  local gradients. Nothing was applied: no data cursor moves. A lane whose partners already committed the step
  (they are one step ahead) is served their results there, in the epoch they were computed in (FTAR's step
  reconciliation, ``ftar.reconcile``), so the redo commits what they committed; when nobody committed it, every
  member reduces it afresh. No lane keeps a result across a failed vote: a partner may redo it (it lost it to an
  epoch push while this lane completed it), and a lane waiting out the redo would lock it out.
- ``Rejoin``: this replica can no longer follow the others (declared dead, behind them with nobody holding the
  results it lacks, or no consistent exchange in ``MAX_ATTEMPTS``): it must restart and catch up as a joiner.

SIGTERM rides the same vote: once ``sigterm()`` was called, this rank's ballots carry it, and the commit whose
tally carries it tells every rank of the replica to stop at that commit boundary.

Also here, the data-slot rule: which slots contributed to a committed step (the mask riding with the last
bucket), hence which data cursors advance (on commit only).

Nothing here does I/O (no collectives, threads or clocks): ``fthsdp.runtime.replica`` drives the machine.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from fthsdp.runtime.errors import SlotConflict
from lighthouse.model import NO_SLOT

MAX_ATTEMPTS = 20
"""Votes one step may fail before the replica gives up and rejoins."""


class Failure(enum.Enum):
    """Why one bucket's exchange did not complete on this lane."""

    NOT_SENT = "not sent"
    """Never handed to FTAR (a joiner's later buckets, when its first one could not learn the step)."""
    INTERRUPTED = "interrupted"
    """FTAR abandoned it (an epoch change or a failed peer): redo it under the next epoch."""
    ERROR = "error"
    """Any other FTAR error (worth a warning): redo it."""
    MISALIGNED = "misaligned"
    """The lane's members disagreed on the step and this replica is not the one behind: redo it."""
    BEHIND = "behind"
    """The lane's members are past this replica's step: its state is stale."""
    EXCLUDED = "excluded"
    """This replica is not a member any more (declared dead while alive)."""

    @property
    def needs_rejoin(self) -> bool:
        return self in (Failure.BEHIND, Failure.EXCLUDED)


@dataclass(frozen=True)
class Exchanged:
    """A bucket exchanged in ``epoch``, under the tag of ``step``, after ``in_collective_s`` inside the collective
    (``ftar.ExchangeResult.in_collective_s``: a slow link's evidence)."""

    epoch: int
    step: int
    in_collective_s: float = 0.0


@dataclass(frozen=True)
class Failed:
    """A bucket not exchanged."""

    why: Failure


LaneEvent = Exchanged | Failed


@dataclass(frozen=True)
class Ballot:
    """One rank's vote: whether its lane failed, the newest and oldest epoch its buckets went in, the step
    they agreed on (-1: none), whether it got SIGTERM, the epoch its lane's failure reports ask the lighthouse
    to move past (0: none; ``LaneEngine.asking``), and the data slot the newest epoch it saw gives its replica
    (``NO_SLOT``: none, a spare; ``fthsdp.runtime.spares``). It also carries the rank's busy time in the step's
    compute, in milliseconds, in its own column of ``ranks`` (the replica's size; 0: none carried): the tally has
    every rank's (fail-slow evidence per rank, ``fthsdp.runtime.pace``), and likewise its lane's time inside the
    step's collectives (``lane_ms``: the member the others wait for arrives last and waits least, a slow link)."""

    failed: bool
    newest: int
    oldest: int
    step: int
    stop: bool
    asking: int = 0
    slot: int = NO_SLOT
    busy_ms: int = 0
    rank: int = 0
    ranks: int = 0
    lane_ms: int = 0

    def encode(self) -> list[int]:
        """The ints whose element-wise MAX over the replica's ranks is the tally (minima ride negated)."""
        if self.ranks and not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank {self.rank} outside the replica's {self.ranks} ranks")
        busy, lanes = [0] * self.ranks, [0] * self.ranks
        if self.ranks:
            busy[self.rank], lanes[self.rank] = max(0, self.busy_ms), max(0, self.lane_ms)
        return [int(self.failed), self.newest, -self.oldest, self.step, -self.step, int(self.stop), self.asking,
                self.slot, *busy, *lanes]


@dataclass(frozen=True)
class Tally:
    """The vote of every rank of the replica, combined."""

    failed: bool
    """Some rank's lane failed."""
    newest: int
    oldest: int
    """The newest and oldest epoch any rank's buckets went in."""
    highest_step: int
    lowest_step: int
    stop: bool
    """Some rank got SIGTERM."""
    asking: int = 0
    """The newest epoch some rank's failure reports ask the lighthouse to move past (0: none)."""
    slot: int = NO_SLOT
    """The replica's data slot as the rank that saw the newest epoch knows it (a live member's slot only goes from
    none to one, so the MAX is the newest): every rank trains it from the next step on."""
    busy_ms: tuple[int, ...] = ()
    """Every rank's busy time in the step's compute, in milliseconds (index: rank; empty: not carried)."""
    lane_ms: tuple[int, ...] = ()
    """Every rank's lane's time inside the step's collectives, in milliseconds (index: rank; empty: not carried)."""

    @classmethod
    def decode(cls, maxed: Sequence[int]) -> Tally:
        """From the element-wise MAX of every rank's ``Ballot.encode()``."""
        failed, newest, oldest, highest, lowest, stop, asking, slot, *columns = (int(x) for x in maxed)
        if len(columns) % 2:
            raise ValueError(f"a tally's per-rank columns come in two halves, got {len(columns)}")
        ranks = len(columns) // 2
        return cls(failed != 0, newest, -oldest, highest, -lowest, stop != 0, asking, slot, tuple(columns[:ranks]),
                   tuple(columns[ranks:]))

    @classmethod
    def of(cls, ballots: Sequence[Ballot]) -> Tally:
        """What the vote's all-reduce computes from these ballots."""
        return cls.decode([max(column) for column in zip(*(b.encode() for b in ballots), strict=True)])

    @property
    def reform(self) -> bool:
        """No rank's lane asks past the newest epoch the buckets went in: nothing failed, or only in older epochs
        (a lane that began the step before an epoch change), whose reports the lighthouse refuses as stale. A redo
        above that epoch must then ask for a re-formed one (``LaneEngine.reset``), or it waits for an epoch
        nobody asked for (found by ``bench recovery --warm-restarts``: the survivors stalled 10 s)."""
        return self.asking < self.newest

    @property
    def passed(self) -> bool:
        """Every rank exchanged every bucket, all in one epoch, for the same step."""
        return not self.failed and self.newest == self.oldest and self.highest_step == self.lowest_step


@dataclass(frozen=True)
class Commit:
    """Apply step ``step``, exchanged in ``epoch``, after ``attempts`` exchanges; ``stop``: then stop (SIGTERM)."""

    step: int
    epoch: int
    attempts: int
    stop: bool


@dataclass(frozen=True)
class Redo:
    """The vote failed; redo this lane's exchange of the step under the next epoch."""

    epochs: tuple[int, ...]
    failed: bool
    """This lane failed (else: the epochs or steps of the replica's lanes differed)."""

    @property
    def reason(self) -> str:
        return "failure" if self.failed else "epoch_change"


@dataclass(frozen=True)
class Rejoin:
    """This replica must restart and catch up."""

    reason: str


Decision = Commit | Redo | Rejoin


class CommitProtocol:
    """One rank's commit protocol. Per step: ``begin``, then per exchange attempt a ``lane`` event for every bucket
    in order, ``ballot`` and ``vote``, until the decision is ``Commit`` or ``Rejoin``."""

    def __init__(self, max_attempts: int = MAX_ATTEMPTS) -> None:
        self.max_attempts = max_attempts
        self._stop = False
        self._attempts = 1
        self._lanes: list[LaneEvent] = []

    def begin(self) -> None:
        """A step's first exchange."""
        self._attempts = 1
        self._lanes = []

    def sigterm(self) -> None:
        """This rank got SIGTERM: from the next ballot on, ask the replica to stop at its next commit."""
        self._stop = True

    def lane(self, event: LaneEvent) -> Rejoin | None:
        """What became of the next bucket. A failure that means this replica's state is stale ends the step."""
        self._lanes.append(event)
        if isinstance(event, Failed) and event.why.needs_rejoin:
            return Rejoin("this replica is behind the others" if event.why is Failure.BEHIND
                          else "this replica was declared dead")
        return None

    def _summary(self) -> tuple[bool, tuple[int, ...], int]:
        """(failed, the epochs of the exchanged buckets (0 for none), the step they agree on or -1)."""
        done = [e for e in self._lanes if isinstance(e, Exchanged)]
        agreed = done[0].step if done and len({e.step for e in done}) == 1 else -1
        failed = len(done) != len(self._lanes) or agreed < 0
        return failed, tuple(e.epoch for e in done) or (0,), agreed

    def ballot(self, asking: int = 0, slot: int = NO_SLOT, busy_ms: int = 0, rank: int = 0,
               ranks: int = 0) -> Ballot:
        """This rank's vote on the attempt whose buckets were reported; ``asking``: ``LaneEngine.asking``;
        ``slot``: its replica's slot in the newest epoch this rank saw; ``busy_ms``: its busy time in the step's
        compute, as ``rank`` of ``ranks``. The lane's time inside the attempt's collectives comes from the
        reported buckets."""
        failed, epochs, agreed = self._summary()
        lane_ms = round(sum(e.in_collective_s for e in self._lanes if isinstance(e, Exchanged)) * 1e3)
        return Ballot(failed, max(epochs), min(epochs), agreed, self._stop, asking, slot, busy_ms, rank, ranks,
                      lane_ms)

    def vote(self, tally: Tally) -> Decision:
        """The replica's vote is in: commit, redo, or give up. The next attempt's buckets are reported afresh."""
        failed, epochs, agreed = self._summary()
        self._lanes = []
        if tally.passed:
            return Commit(agreed, max(epochs), self._attempts, tally.stop)
        if self._attempts >= self.max_attempts:
            return Rejoin(f"no consistent exchange in {self._attempts} attempts")
        self._attempts += 1
        return Redo(epochs, failed)


def contributing_slots(mask: Sequence[float], contributors: int, step: int) -> tuple[int, ...]:
    """The data slots that contributed to ``step``, from the averaged slot mask (slot i is 1/contributors if its
    replica contributed, else 0). Two replicas on one slot (or disagreeing slot counts) is a ``SlotConflict``."""
    counts = [round(m * contributors) for m in mask]
    if sum(counts) != contributors or any(c > 1 for c in counts):
        raise SlotConflict(f"step {step}: slot counts {counts} for {contributors} contributors: two replicas have "
                           "the same FTHSDP_REPLICA_INDEX, or the job's FTHSDP_NUM_REPLICAS differs between replicas")
    return tuple(i for i, c in enumerate(counts) if c)


def advance_cursors(cursors: Sequence[int], slots: Sequence[int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A commit's data cursors: each contributing slot moves past the batch it trained. Returns (the new cursors,
    (slot, batch index) of every batch the step trained)."""
    batches = tuple((s, int(cursors[s])) for s in slots)
    new = [int(c) for c in cursors]
    for s in slots:
        new[s] += 1
    return new, batches
