"""A simulated replica's training loop over its lanes (docs/design.md §3), modelled on ``fthsdp.runtime.replica``
and driving the real commit protocol (``fthsdp.runtime.commit``: ``CommitProtocol`` per rank, ``Tally`` for the
replica-local vote, ``advance_cursors`` for the data slots; ``fthsdp.runtime.buckets.failure_of`` for what an
exchange's error means).

A step: compute (``STEP_S``, only when it trains a batch), one exchange per bucket on every lane, the vote, then
commit (the results recorded, the cursors advanced, the held results of older steps forgotten), redo (every lane
``reset`` above the tally's newest epoch, the buckets again) or rejoin (the process exits: a survivor that does
pays). A joiner exchanges zeros with ``tag=None`` until its first bucket teaches it the step, keeps the results it
commits, then takes a source's state at a commit boundary and replays them (the catch-up, as a model: no bytes)
before it contributes. A replica that starts active while the job has committed steps resumes from the job's
checkpoint. After the last step every lane runs the end-of-job barrier (an exchange of zeros tagged with the next
step, op sum), then the replica leaves as finished.

With orphan slots (``--sim-orphans``; docs/design.md §7, as the runtime's ``carry``) a step trains what the newest epoch
deals the member (``fthsdp.runtime.orphans``: its slot's micro-batches and its share of the orphans'), its compute
time grows with it, its lanes join only a group whose epoch deals it the same (``_fits``), and a redo first trains
what a newer epoch deals it (``_redeal``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from ftar.errors import FTARError
from fthsdp.chaos.sim.lanes import LaneConfig, Request, Result, SimGroup, SimLane
from fthsdp.chaos.sim.world import World
from fthsdp.runtime import orphans as orph
from fthsdp.runtime.buckets import failure_of
from fthsdp.runtime.commit import Commit, CommitProtocol, Exchanged, Failed, Failure, Rejoin, Tally, advance_cursors
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.spares import Shadow
from lighthouse import membership as m
from lighthouse.epoch_view import EpochView
from lighthouse.model import NO_SLOT

STEP_S = 1.0
"""A step's compute (forward and backward), for a replica that trains a batch."""
RETRY_S = 0.2
"""How soon a joiner tries its catch-up again when it cannot yet (no step learned, no source)."""
SPARE_EARLY = RuntimeConfig.spare_early
"""``FTHSDP_SPARE_EARLY``'s default: a spare handed a slot within this fraction of its median step trains it."""
PARTS = 2
"""With orphan slots: micro-batches per slot and step (the unit an orphan's batch is dealt out in)."""

NOT_SENT = FTARError("not sent")
"""A joiner's later bucket on a lane whose first one failed (``Failure.NOT_SENT``)."""

Record = tuple[tuple[int, int, tuple[int, ...]], ...]
"""What a committed step applied: per lane and bucket, (sum, contributors, the slot mask's positions trained: the
contributing slots; with orphan slots, ``PARTS`` per slot, ``fthsdp.runtime.orphans.position``)."""


class Process(Protocol):
    """The replica process a trainer runs in (``fthsdp.chaos.sim.replica.SimReplica``)."""

    rid: str
    inc: str
    index: int
    """Its replica's index: the data slot it asks for (none from the job's slot count up: a spare)."""
    alive: bool
    step: int
    """The step its heartbeats carry."""
    known: m.Epoch | None

    @property
    def world(self) -> World: ...

    def run(self, fn: Callable[[], None]) -> None: ...

    def report(self, suspect: str, epoch: int, early: bool) -> None: ...

    def exit(self, why: str, finished: bool = False) -> None: ...

    def finish(self, step: int) -> None: ...

    def can_check_in(self) -> bool: ...

    def source(self) -> SimTrainer | None: ...


def grad(slot: int, step: int, lane: int, bucket: int) -> int:
    """The gradient that slot ``slot`` contributes to bucket ``bucket`` of lane ``lane`` at ``step``: a small
    integer that differs between slots and steps, so that a sum of the wrong contributions shows."""
    return 1 + (slot * 7919 + step * 104_729 + lane * 131 + bucket * 17) % 9973


class SimTrainer:
    """The training loop of one replica process: its lanes, its commit protocols, its state as a history."""

    def __init__(self, proc: Process, lanes: int, buckets: int, slots: int, total_steps: int,
                 lane_config: LaneConfig, groups: Callable[[EpochView, int], SimGroup],
                 record: Callable[[SimTrainer, int, Record], None], assigned: bool = False,
                 orphans: bool = False, pin: bool = True) -> None:
        self.proc = proc
        self.assigned = assigned or orphans
        """The lighthouse hands out the slots (``lighthouse.slots``: a job with spares); else each trains its index."""
        self.orphans = orphans
        """Orphan slots (docs/design.md §7, the constant global batch, as the runtime's ``carry``): the holders
        train the micro-batches of the slots nobody holds (``fthsdp.runtime.orphans.deal``), a redo first trains
        what a newer epoch deals it, and every committed step trains every slot's batch."""
        self.pin = pin
        """With orphan slots: exchange a contribution only in a group whose epoch deals this member what it trained
        (``_fits``; off: the ``unpinned-orphans`` variant)."""
        self.parts = PARTS if orphans else 1
        self._have: tuple[int, ...] = ()
        """With orphan slots: the slot mask's positions this step's contribution holds (computed)."""
        self.slot = proc.index if proc.index < slots else NO_SLOT
        """The slot it trains this step (``fthsdp.runtime.spares``: the tally's, taken at each commit)."""
        self.world: World = proc.world
        self.rid, self.inc = proc.rid, proc.inc
        self.buckets, self.slots, self.total_steps = buckets, slots, total_steps
        self._lane_config = lane_config
        self._record = record
        self.lanes = [SimLane(self, i, groups) for i in range(lanes)]
        self.protocols = [CommitProtocol() for _ in range(lanes)]
        self.step = 0
        self.history: dict[int, Record] = {}
        """Step -> what its commit applied: the replica's state, as the checks compare it."""
        self.committed_at: dict[int, float] = {}
        self.cursors = [0] * slots
        self.started = self.joining = self.caught_up = self.barrier = False
        self.lane_step: list[int | None] = [None] * lanes
        """Per lane, the step it exchanges (a joiner's: None until its first bucket teaches it)."""
        self._outcomes: list[list[Result | FTARError | None]] = []
        self._view: EpochView | None = None
        self.shadow = Shadow(clock=lambda: self.world.now)
        """A spare's step clock (``fthsdp.runtime.spares.Shadow``): is a slot handed over now early in the step?"""
        self._trains = False
        """Whether this step trains a batch (a spare handed a slot early trains it from the step it got it)."""

    # --- what a lane reaches (``fthsdp.chaos.sim.lanes.Host``) ----------------------------------------------------

    def run(self, fn: Callable[[], None]) -> None:
        self.proc.run(fn)

    def current(self) -> EpochView | None:
        known = self.proc.known
        if known is None:
            return None
        if self._view is None or self._view.number != known.number:
            self._view = EpochView("sim", known.number, known.members, "sim", known.created_at, known.reason,
                                   plane=known.plane)
        return self._view

    def report(self, suspect: str, epoch: int, early: bool) -> None:
        self.proc.report(suspect, epoch, early)

    def can_check_in(self) -> bool:
        return self.proc.can_check_in()

    def config(self) -> LaneConfig:
        return self._lane_config

    # --- the loop -----------------------------------------------------------------------------------------------

    def start(self, joining: bool, resume: tuple[int, dict[int, Record]] | None) -> None:
        """The process is in its first epoch: train (``joining``: catch up first); ``resume``: the job's checkpoint,
        for a replica that starts active while the job has committed steps."""
        if self.started:
            return
        self.started, self.joining = True, joining
        if not joining:
            if resume is not None:
                self.step, self.history = resume[0], dict(resume[1])
                self.cursors = cursors_of(self.history, self.slots, self.parts)
            self.lane_step = [self.step] * len(self.lanes)
        self.proc.step = self.step
        self._begin()

    def on_epoch(self) -> None:
        for lane in self.lanes:
            lane.on_epoch()

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()

    def _begin(self) -> None:
        for p in self.protocols:
            p.begin()
        if self.orphans:  # what the newest epoch deals it (a spare given a slot and a returned replica included)
            self._have = () if self.joining or self.proc.known is None else self._dealt(self.proc.known)
            self._trains = bool(self._have)
        else:
            self._trains = not self.joining and self.slot != NO_SLOT
            if not self._trains and not self.joining:  # a spare: handed a slot already, it trains it in this step
                self._hand_over(self._seen())
        if self._trains:  # with orphan slots the compute grows with the micro-batches dealt
            compute_s = STEP_S * len(self._have) / self.parts if self.orphans else STEP_S
            self.world.after(compute_s, lambda: self.run(self._launch))
        else:
            self._launch()  # a joiner's or a spare's zeros: nothing to compute

    def _hand_over(self, slot: int) -> bool:
        """A spare handed ``slot`` early in its step trains it in this step (``fthsdp.runtime.spares.spare_step``:
        at the step's start, or in the redo of its exchange); later, it sends zeros and trains it from the next."""
        if slot == NO_SLOT or not self.assigned or not self.shadow.early(SPARE_EARLY):
            return False
        self.world.log(f"{self.inc} step {self.step}: slot {slot} handed over early: training its batch")
        self.slot, self._trains = slot, True
        return True

    def _launch(self) -> None:
        """Every bucket of the step on every lane (a lane that does not know the step yet: its first bucket,
        ``tag=None``, then the others once it has learned it)."""
        self._outcomes = [[None] * self.buckets for _ in self.lanes]
        for i, lane in enumerate(self.lanes):
            if self.lane_step[i] is None:
                lane.submit(self._request(i, 0, None, functools.partial(self._first, i)))
                continue
            for b in range(self.buckets):
                lane.submit(self._request(i, b, self.lane_step[i], functools.partial(self._bucket, i, b)))

    def _request(self, lane: int, bucket: int, step: int | None, done: Callable[[Result | FTARError], None]) \
            -> Request:
        if self.orphans:
            contribute, positions = not self.joining and bool(self._have), self._have
        else:
            contribute, positions = not self.joining and self.slot != NO_SLOT, (self.slot,)
        value = sum(grad(p, step, lane, bucket) for p in positions) if contribute and step is not None else 0
        return Request(None if step is None else step * self.buckets + bucket, value, positions, contribute,
                       redo=False, new_epoch_ok=bucket == 0, done=done,
                       fits=self._fits if self.orphans and self.pin and not self.joining else None)

    def _tally(self) -> Tally:
        """The replica-local vote: the MAX of every lane's ballot."""
        seen = self._seen()
        return Tally.of([p.ballot(lane.asking, seen) for p, lane in zip(self.protocols, self.lanes, strict=True)])

    def _seen(self) -> int:
        """Its slot in the newest epoch its process saw (``fthsdp.runtime.core.StepCore.seen_slot``)."""
        me = self.proc.known.member(self.rid) if self.proc.known is not None else None
        return me.slot if me is not None and me.incarnation == self.inc else NO_SLOT

    def _first(self, lane: int, out: Result | FTARError) -> None:
        """A joiner's first bucket on ``lane``: it learns the step, and sends the others."""
        if isinstance(out, Result):
            step = self.lane_step[lane] = out.tag // self.buckets
            for b in range(1, self.buckets):
                self.lanes[lane].submit(self._request(lane, b, step, functools.partial(self._bucket, lane, b)))
        else:
            for b in range(1, self.buckets):
                self._outcomes[lane][b] = NOT_SENT
        self._bucket(lane, 0, out)

    def _bucket(self, lane: int, bucket: int, out: Result | FTARError) -> None:
        self._outcomes[lane][bucket] = out
        if all(o is not None for row in self._outcomes for o in row):
            self._vote()

    def _vote(self) -> None:
        """Every lane reports its buckets to its protocol; the vote (the MAX of the ballots); the decision."""
        for i, row in enumerate(self._outcomes):
            for out in row:
                if isinstance(out, Result):
                    event: Exchanged | Failed = Exchanged(out.epoch, out.tag // self.buckets)
                elif out is NOT_SENT:
                    event = Failed(Failure.NOT_SENT)
                else:
                    assert isinstance(out, FTARError)
                    event = Failed(failure_of(out))
                rejoin = self.protocols[i].lane(event)
                if rejoin is not None:
                    self.proc.exit(f"rejoin: {rejoin.reason} ({out})")
                    return
        tally = self._tally()
        decisions = [p.vote(tally) for p in self.protocols]
        decision = decisions[0]
        if isinstance(decision, Rejoin):
            self.proc.exit(f"rejoin: {decision.reason}")
            return
        if isinstance(decision, Commit):
            if self.assigned and tally.slot != self.slot:  # as ``fthsdp.runtime.core.StepCore.take_slot``
                self.world.log(f"{self.inc} trains slot {tally.slot} from step {decision.step + 1} (was {self.slot})")
                self.slot = tally.slot
            results = [[o for o in row if isinstance(o, Result)] for row in self._outcomes]
            self._commit(decision.step, results)
            return
        self.world.log(f"{self.inc} step {self.step}: vote failed ({tally}); redo")
        for lane in self.lanes:
            lane.reset(after=tally.newest, reform=tally.reform)  # partners that committed moved on there
        if self.orphans and not self.joining and (extra := self._redeal()):
            self.world.after(extra, lambda: self.run(self._launch))  # what the newer epoch deals it: compute first
        elif not self.orphans and not self._trains and not self.joining and self._hand_over(tally.slot):
            self.world.after(STEP_S, lambda: self.run(self._launch))  # the slot's batch: compute first
        else:
            self._launch()

    def _dealt(self, epoch: m.Epoch | EpochView) -> tuple[int, ...]:
        """With orphan slots: the slot mask's positions ``epoch`` deals this member (``fthsdp.runtime.orphans.dealt``,
        as the runtime's)."""
        return orph.dealt(epoch.members, self.rid, self.inc, self.slots, self.parts)

    def _fits(self, epoch: EpochView) -> bool:
        """With orphan slots: whether this step's contribution may be exchanged in ``epoch``'s group: it holds
        exactly what ``epoch`` deals this member. Every member of a group checks it, so every part of every slot
        is in the group's sum exactly once; a member it does not fit is interrupted before any data moves, and
        redoes the step's exchange once it has trained what the newest epoch deals it (``_redeal``)."""
        return self._dealt(epoch) == self._have

    def _redeal(self) -> float:
        """With orphan slots, before a redo: train what the newest epoch deals this member beyond what its
        contribution holds (a holder died during the step; a spare was handed a slot; a joiner became active). A
        contribution that holds parts it is no longer dealt is computed afresh: its micro-batches are summed, none
        can be taken out. Returns the compute time (0: nothing to compute)."""
        want = () if self.proc.known is None else self._dealt(self.proc.known)
        if want == self._have:
            return 0.0
        extra = len(want) - len(self._have) if set(self._have) <= set(want) else len(want)
        self.world.log(f"{self.inc} step {self.step}: epoch {self.proc.known.number if self.proc.known else 0} "
                       f"deals it parts {list(want)} (it holds {list(self._have)}): "
                       + (f"training {extra} part(s) first" if want else "it contributes nothing"))
        self._have, self._trains = want, bool(want)
        return STEP_S * extra / self.parts

    def _commit(self, step: int, results: list[list[Result]]) -> None:
        if not self._trains and not self.joining:
            self.shadow.committed()  # a spare's step clock: its commits as a spare (``spares.spare_step``)
        record: Record = tuple((r.value, r.contributors, r.slots) for row in results for r in row)
        self._record(self, step, record)
        self.history[step] = record
        self.committed_at[step] = self.world.now
        self.cursors, _ = advance_cursors(self.cursors, trained_slots(results[0][-1].slots, self.slots, self.parts,
                                                                      step))
        for lane in self.lanes:
            lane.forget_before(step * self.buckets)  # hold this step's results until the next commit
        self.step = step + 1
        self.lane_step = [self.step] * len(self.lanes)
        self.proc.step = self.step
        if self.step >= self.total_steps:
            self._end_of_job()
        else:
            self._begin()

    # --- catching up ----------------------------------------------------------------------------------------------

    def catch_up(self, source: SimTrainer | None) -> bool:
        """Take ``source``'s state at a commit boundary and replay the kept steps after it. False: not yet (no step
        learned, or the source is behind the steps this joiner kept)."""
        if not self.joining or not self.history or source is None:
            return False
        first = min(self.history)
        at = min(source.step, self.step)
        if at < first:
            return False
        self.history = {t: r for t, r in source.history.items() if t < at} | \
            {t: r for t, r in self.history.items() if t >= at}
        self.cursors = cursors_of(self.history, self.slots, self.parts)
        self.joining, self.caught_up = False, True
        self.world.log(f"{self.inc} caught up at step {self.step} from {source.inc} (its state at step {at})")
        self.proc.step = self.step
        return True

    # --- the end ----------------------------------------------------------------------------------------------------

    def _end_of_job(self) -> None:
        """``Replica._end_of_job``: the barrier (zeros tagged with the next step's first bucket, op sum) on every
        lane, through the vote like a step: a lane that lost it while another completed it redoes it with the
        others, so that partners split the same way meet again. Bounded; then leave as finished. A joiner that
        has not caught up catches up first (it must hold the job's state to end it)."""
        if self.barrier or not self.proc.alive:
            return
        if self.joining and not self.catch_up(self.proc.source()):
            self.world.after(RETRY_S, lambda: self.run(self._end_of_job))
            return
        self.barrier = True
        self.world.log(f"{self.inc} at the last step {self.step}: end-of-job barrier")
        for p in self.protocols:
            p.begin()
        self._barrier_round()
        wait_s = self._lane_config.epoch_wait_s * 2 + 60
        self.world.after(wait_s, lambda: self.run(lambda: self._leave("not every member confirmed the last step")))

    def _barrier_round(self) -> None:
        self._outcomes = [[None] for _ in self.lanes]
        for i, lane in enumerate(self.lanes):
            lane.submit(Request(self.step * self.buckets, 0, (self.slot,), False, redo=False, new_epoch_ok=True,
                                done=functools.partial(self._barrier_lane, i)))

    def _barrier_lane(self, lane: int, out: Result | FTARError) -> None:
        self._outcomes[lane][0] = out
        if any(row[0] is None for row in self._outcomes):
            return
        for p, row in zip(self.protocols, self._outcomes, strict=True):
            done = row[0]
            p.lane(Exchanged(done.epoch, self.step) if isinstance(done, Result) else
                   Failed(failure_of(done) if isinstance(done, FTARError) else Failure.ERROR))
        tally = self._tally()
        decision = [p.vote(tally) for p in self.protocols][0]
        if isinstance(decision, Commit):
            self._leave("")
        elif isinstance(decision, Rejoin):
            self._leave(decision.reason)
        else:
            self.world.log(f"{self.inc} end-of-job barrier: vote failed ({tally}); again")
            for lane_ in self.lanes:
                lane_.reset(after=tally.newest, reform=tally.reform)
            self._barrier_round()

    def _leave(self, warning: str) -> None:
        if warning:
            self.world.log(f"{self.inc} end of job: {warning}; leaving anyway")
        self.proc.finish(self.step)


def trained_slots(positions: tuple[int, ...], slots: int, parts: int, step: int) -> tuple[int, ...]:
    """The slots a step trained, from the slot mask's positions its contributors trained (``parts`` per slot:
    ``fthsdp.runtime.orphans.trained``; a conflict is the cluster's violation to report, ``SimCluster._record``,
    and counts as trained here)."""
    if parts == 1:
        return positions
    try:
        return orph.trained(orph.counts(positions, slots, parts), parts, step)
    except orph.OrphanConflict:
        return tuple(sorted({p // parts for p in positions}))


def cursors_of(history: dict[int, Record], slots: int, parts: int = 1) -> list[int]:
    """The data cursors after ``history``: per slot, the steps it contributed to."""
    cursors = [0] * slots
    for step, record in history.items():
        for s in trained_slots(record[-1][2], slots, parts, step):
            cursors[s] += 1
    return cursors
