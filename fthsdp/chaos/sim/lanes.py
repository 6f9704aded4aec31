"""The data plane of ``fthsdp chaos --sim`` with lanes: each rank of a replica runs one FTAR lane, modelled on
``ftar.engine.LaneEngine``'s sequencing and decided by FTAR's real rules (``ftar.rules``: the epoch an attempt runs
in, ``LaneState.place``'s mid-sequence rule, ``CollectiveWatch``'s abandon and deadline, the tag check, ``blame``;
``ftar.reconcile``: the holder rule over ``HeldResults``).

A collective is a model, not bytes: an epoch's group of a lane (``SimGroup``) takes its members' contributions to
its k-th collective; once every member has sent one, each member completes at its own moment a few milliseconds
later, unless the group broke before that moment (a member died, dropped the group or timed out): so a collective
completes for all of its members or fails for some of them at any point, as a ring all-reduce does. Tensors are
small integers: a result is the sum of the contributions with the contributor count and the slot-mask positions,
so that the checks can recompute it. A hung member or one cut from its peers holds every collective of its groups
until it is back; its partners give up at their deadline.

What the model leaves out: the bytes, the staging buffers, the store's keys (a member "checks in" after a failure
when it can reach the lighthouse that hosts the store), the tag proof's arithmetic (members that paired different
tags in one collective fail it, as the proof makes them), and the catch-up transfer (``fthsdp.chaos.sim.trainer``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ftar.errors import FTARError, Interrupted, Misaligned
from ftar.reconcile import Held, HeldResults, holder_of, holder_probe, needs_reconciling
from ftar.rules import (
    REPORT_AGAIN_S,
    CollectiveWatch,
    LaneState,
    PendingReports,
    Recovery,
    Verdict,
    agreed_tag,
    alignment_probe,
    blame,
    newer,
    no_epoch,
    recovery,
)
from fthsdp.chaos.sim.world import World
from lighthouse.epoch_view import EpochView

DATA_S = (0.001, 0.02)
"""How long after the last member's contribution a collective completes at each member (uniform, per member)."""
EARLY_REPORT_S = 0.02
"""As ``ftar.blame.EARLY_REPORT_S``: the members still missing this long into the grace are reported early."""


class Value:
    """One tensor of a result, as ``ftar.reconcile.HeldResults`` sees it: a value with a version counter."""

    __slots__ = ("_version", "value")

    def __init__(self, value: object) -> None:
        self.value = value
        self._version = 0


@dataclass(frozen=True)
class Result:
    """A completed exchange: the sum of the contributions, by whom, in which epoch, under which tag."""

    tag: int
    epoch: int
    value: int
    contributors: int
    slots: tuple[int, ...]


@dataclass
class Request:
    """An exchange as queued on a lane (``LaneEngine.allreduce``'s arguments that matter here)."""

    tag: int | None
    value: int
    slots: tuple[int, ...]
    """The slot-mask positions its contribution trains (its slot; with orphan slots, micro-batches of slots)."""
    contribute: bool
    redo: bool
    new_epoch_ok: bool
    done: Callable[[Result | FTARError], None]
    fits: Callable[[EpochView], bool] | None = None
    """Whether the contribution may be exchanged in an epoch's group (orphan slots: it holds what that epoch deals
    its member, ``fthsdp.chaos.sim.trainer.SimTrainer._fits``); not: ``Interrupted`` before any data moves."""


class Host(Protocol):
    """What a lane reaches of its process and the cluster (``fthsdp.chaos.sim.trainer``)."""

    world: World
    rid: str
    inc: str

    def run(self, fn: Callable[[], None]) -> None: ...

    def current(self) -> EpochView | None: ...

    def report(self, suspect: str, epoch: int, early: bool) -> None: ...

    def can_check_in(self) -> bool: ...

    def config(self) -> LaneConfig: ...


@dataclass(frozen=True)
class LaneConfig:
    """A lane's settings (``ftar.FTARConfig``'s that matter here)."""

    timeout_s: float
    connect_timeout_s: float
    epoch_wait_s: float
    blame_grace_s: float = 0.2
    abandon_grace_s: float = 1.0
    max_attempts: int = 10
    reconcile: bool = True
    """Step reconciliation (``ftar.reconcile``); off in the ``local-vote`` variant."""


@dataclass
class _Op:
    """One collective of a group: what each member sent, and when it completes at each."""

    sent: dict[str, tuple[int | None, int, tuple[int, ...], bool]] = field(default_factory=dict)
    """rid -> (tag, value, slot-mask positions, contribute)."""
    waiting: dict[str, Callable[[object], None]] = field(default_factory=dict)


class SimGroup:
    """One epoch's group of one lane: the rendezvous, the tag check and the collectives, in order."""

    def __init__(self, world: World, epoch: EpochView, lane: int,
                 blocked_until: Callable[[SimGroup], float | None],
                 reduced: Callable[[SimGroup, float, float], None]) -> None:
        self.world, self.epoch, self.lane = world, epoch, lane
        self._blocked_until = blocked_until
        """When the group's members can all reach each other again (None: now): the cluster's network."""
        self._on_reduced = reduced
        """Told when a collective starts completing (its first and last member's completion, from now): the
        mid-exchange kill's hook."""
        self.ids = epoch.replica_ids
        self.arrived: dict[str, tuple[int | None, HeldResults, Callable[[object], None]]] = {}
        self.ops: list[_Op] = []
        self.sent_count: dict[str, int] = {}
        self.broken_at: float | None = None
        self.why = ""
        self.failures: dict[int, set[str]] = {}
        """Check-ins after a failure, by how many collectives the member had sent in the group (0: the
        rendezvous), as ``EpochGroup.failure_key``."""
        self._hold: list[Callable[[], None]] = []

    def broken(self) -> bool:
        return self.broken_at is not None

    def break_(self, why: str) -> None:
        """A member died, gave the group up or timed out: every collective not completed at a member fails there
        (its connections reset)."""
        if self.broken_at is not None:
            return
        self.broken_at, self.why = self.world.now, why
        for op in self.ops:
            for cb in list(op.waiting.values()):
                self.world.after(self.world.rng.uniform(*DATA_S), functools.partial(cb, f"peer gone: {why}"))
            op.waiting.clear()

    def arrive(self, rid: str, tag: int | None, held: HeldResults, cb: Callable[[object], None]) -> None:
        """``rid`` starts the rendezvous with its tag; ``cb`` gets the tag check's outcome: (highest, lowest, holder
        rank or None, the holder's results) or an error text."""
        if self.broken():
            self.world.after(self.world.rng.uniform(*DATA_S), functools.partial(cb, f"peer gone: {self.why}"))
            return
        self.arrived[rid] = (tag, held, cb)
        if len(self.arrived) == len(self.ids):
            self._when_clear(self._align)

    def missing(self) -> list[str]:
        return [r for r in self.ids if r not in self.arrived]

    def _when_clear(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no member is hung or cut from its peers (the collective needs all of them)."""
        self._hold.append(fn)
        self._try_hold()

    def _try_hold(self) -> None:
        if not self._hold or self.broken():
            return
        blocked = self._blocked_until(self)
        if blocked is not None:
            self.world.at(blocked, self._try_hold)
            return
        hold, self._hold = self._hold, []
        for fn in hold:
            fn()

    def _align(self) -> None:
        """The tag check and the holder probe (``LaneEngine._check_alignment``), each the MAX of the members'
        probes, done at once for everyone."""
        probes = [alignment_probe(self.arrived[r][0]) for r in self.ids]
        highest, lowest = max(p[0] for p in probes), -max(p[1] for p in probes)
        holder: int | None = None
        served: list[tuple[int, Held]] = []
        if needs_reconciling(highest, lowest):
            world = len(self.ids)
            holder = holder_of([max(holder_probe(self.arrived[r][0], highest, lowest, self.arrived[r][1], rank,
                                                 world)[0] for rank, r in enumerate(self.ids))], world)
            if holder is not None:
                served = self.arrived[self.ids[holder]][1].span(lowest, highest)
        outcome = (highest, lowest, holder, served)
        self._deliver_all([(r, self.arrived[r][2]) for r in self.ids], outcome)

    def _deliver_all(self, targets: list[tuple[str, Callable[[object], None]]], outcome: object) -> None:
        t0 = self.world.now
        times = [t0 + self.world.rng.uniform(*DATA_S) for _ in targets]
        for at, (_, cb) in zip(times, targets, strict=True):
            self.world.at(at, functools.partial(self._complete, at, cb, outcome))
        if times:
            self._on_reduced(self, min(times) - t0, max(times) - t0)

    def _complete(self, at: float, cb: Callable[[object], None], outcome: object) -> None:
        if self.broken_at is not None and self.broken_at < at:
            cb(f"peer gone: {self.why}")
        else:
            cb(outcome)

    def send(self, rid: str, tag: int | None, value: int, slots: tuple[int, ...], contribute: bool,
             cb: Callable[[object], None]) -> None:
        """``rid``'s contribution to its next collective in this group; ``cb`` gets the ``Result`` fields
        ``(tags, value, contributors, slots)`` or an error text."""
        k = self.sent_count.get(rid, 0)
        self.sent_count[rid] = k + 1
        while len(self.ops) <= k:
            self.ops.append(_Op())
        op = self.ops[k]
        if self.broken():
            self.world.after(self.world.rng.uniform(*DATA_S), functools.partial(cb, f"peer gone: {self.why}"))
            return
        op.sent[rid] = (tag, value, slots, contribute)
        op.waiting[rid] = cb
        if len(op.sent) == len(self.ids):
            self._when_clear(functools.partial(self._reduce, op))

    def _reduce(self, op: _Op) -> None:
        tags = {s[0] for s in op.sent.values()}
        if len(tags) != 1:  # the tag proof fails at every member: out of step
            outcome: object = f"members exchanged different tags in one group: {sorted(tags, key=str)}"
        else:
            contributing = [s for s in op.sent.values() if s[3]]
            outcome = (sum(s[1] for s in contributing), len(contributing),
                       tuple(sorted(x for s in contributing for x in s[2])))
        targets = list(op.waiting.items())
        op.waiting.clear()
        self._deliver_all(targets, outcome)

    def check_in(self, key: int, rid: str) -> None:
        self.failures.setdefault(key, set()).add(rid)


class SimLane:
    """Lane ``lane`` of one replica process: its requests in call order, each through the engine's attempts."""

    def __init__(self, host: Host, lane: int, groups: Callable[[EpochView, int], SimGroup]) -> None:
        self.host, self.lane = host, lane
        self.cfg = host.config()
        self._groups = groups
        self.state = LaneState(host.rid, lane)
        self.reports = PendingReports()
        self.held = HeldResults()
        self.group: SimGroup | None = None
        self.tag = 0
        self.served: dict[int, Held] = {}
        self.queue: list[Request] = []
        self.busy = False
        self.closed = False
        self._wait: Callable[[], None] | None = None
        """What to re-run when a newer epoch arrives (a lane waiting for an epoch or in a collective)."""
        self._token: object | None = None
        """The wait in progress: a timer or an answer for an older one is ignored."""

    # --- requests ---------------------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self.queue.append(req)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if self.closed or not self.queue:
            self.busy = False
            return
        self.busy = True
        req = self.queue.pop(0)
        try:
            self.state.admit()
        except FTARError as e:
            self._finish(req, e)
            return
        self._attempt(req, 0)

    def _finish(self, req: Request, out: Result | FTARError) -> None:
        self._wait = self._token = None
        if not self.closed:
            req.done(out)
        self._next()

    def forget_before(self, tag: int) -> None:
        self.held.forget_before(tag)

    @property
    def asking(self) -> int:
        """As ``LaneEngine.asking``."""
        return self.reports.asking

    def reset(self, after: int, reform: bool = False) -> None:
        """As ``LaneEngine.reset``."""
        self.state.reset()
        if after > self.state.failed_epoch:
            self.state.failed(after)
            current = self.host.current()
            if reform and current is not None and current.number == after:
                self.reports.reform(current, self.host.rid, self.host.world.now)

    def close(self) -> None:
        """The process ended: its groups break for the others."""
        self.closed = True
        self._wait = None
        if self.group is not None:
            self.group.break_(f"{self.host.inc} died")

    def on_epoch(self) -> None:
        """A newer epoch reached this process."""
        if self._wait is not None:
            self._wait()

    # --- one exchange ---------------------------------------------------------------------------------------

    def _attempt(self, req: Request, count: int) -> None:
        if count >= self.cfg.max_attempts:
            self._finish(req, FTARError(f"lane {self.lane}: exchange failed in {count} epochs"))
            return
        deadline = self.host.world.now + self.cfg.epoch_wait_s
        self._usable(req, count, deadline)

    def _usable(self, req: Request, count: int, deadline: float) -> None:
        """``LaneEngine._usable_epoch``: the newest epoch above the failed one that has this replica, waited for up
        to ``epoch_wait_s``."""
        token = self._token = object()

        def check() -> None:
            if self._token is not token:
                return
            try:
                choice = self.state.pick(self.host.current())
            except FTARError as e:
                self._finish(req, e)
                return
            if isinstance(choice, EpochView):
                self._token = self._wait = None
                self._place(req, count, choice)
                return
            if self.host.world.now >= deadline:
                self._finish(req, no_epoch(self.host.current(), choice, self.host.rid, self.cfg.epoch_wait_s))
                return
            again = self.reports.due(self.host.current(), self.host.world.now)
            if again is not None:
                self.host.world.log(f"{self.host.inc} lane {self.lane}: no epoch after {self.reports.epoch} yet: "
                                    f"reporting {', '.join(again.suspects)} again")
                for r in again.suspects:
                    self.host.report(r, self.reports.epoch, False)
            if self.reports.verdict is not None:
                self.host.world.after(REPORT_AGAIN_S, lambda: self.host.run(check))
        self._wait = check
        self.host.world.at(deadline, lambda: self.host.run(check))
        check()

    def _drop_group(self) -> None:
        self.served = {}
        group, self.group = self.group, None
        if group is not None:
            group.break_(f"{self.host.inc} gave it up")

    def _place(self, req: Request, count: int, usable: EpochView) -> None:
        held = self.group.epoch if self.group is not None else None
        try:
            epoch = self.state.place(usable, held, req.new_epoch_ok, req.redo)
            if req.fits is not None and not req.fits(epoch):
                raise Interrupted(f"dealt under another epoch than {epoch.number}", epoch.number)
        except FTARError as e:  # Interrupted
            self._drop_group()
            self._finish(req, e)
            return
        if self.group is not None and self.group.epoch.number == epoch.number:
            if req.tag is None:
                self._finish(req, FTARError("tag=None (joiner) is only valid for the first exchange of an epoch"))
                return
            self._run(req, count, epoch)
            return
        self._drop_group()
        group = self._groups(epoch, self.lane)
        self.group = group
        started = self.host.world.now
        token = self._arm(req, count, epoch, group, started, rendezvous=True)
        group.arrive(self.host.rid, req.tag, self.held, lambda out: self.host.run(
            lambda: self._aligned(req, count, epoch, group, token, out)))

    def _arm(self, req: Request, count: int, epoch: EpochView, group: SimGroup, started: float,
             rendezvous: bool) -> object:
        """Watch the wait: its deadline, and (``CollectiveWatch``) a newer epoch that ends it. Returns the wait's
        token: an answer for an older wait (a group of the same plane reused by a later attempt) is ignored."""
        timeout = self.cfg.connect_timeout_s if rendezvous else self.cfg.timeout_s
        watch = CollectiveWatch(epoch, started, timeout, self.cfg.abandon_grace_s)
        if rendezvous:
            watch.deadline = started + timeout  # the rendezvous' own timeout
        token = self._token = object()

        def check() -> None:
            if self._token is not token or self.group is not group:
                return
            now = self.host.world.now
            if rendezvous:
                if newer(self.host.current(), epoch):  # superseded: Abandoned at once
                    self._fail(req, count, epoch, group, "abandoned", abandoned=True)
                elif now >= watch.deadline:
                    self._fail(req, count, epoch, group, f"rendezvous timed out, missing {group.missing()}")
                return
            if watch.watching:
                watch.notice(self.host.current(), now)
            verdict = watch.verdict(now, stopping=False)
            if verdict is Verdict.DEADLINE:
                self._fail(req, count, epoch, group, f"collective missed its {timeout}s deadline")
            elif verdict is Verdict.ABANDON:
                self._fail(req, count, epoch, group, "newer epoch pushed mid-exchange", abandoned=True)
            elif watch.give_up_at is not None:
                self.host.world.at(watch.give_up_at, lambda: self.host.run(check))
        self._wait = check
        self.host.world.at(watch.deadline, lambda: self.host.run(check))
        check()
        return token

    def _aligned(self, req: Request, count: int, epoch: EpochView, group: SimGroup, token: object,
                 out: object) -> None:
        if self._token is not token or self.closed:
            return
        self._token = None
        if isinstance(out, str):
            self._fail(req, count, epoch, group, out)
            return
        assert isinstance(out, tuple)
        highest, lowest, holder, served = out
        if not self.cfg.reconcile:
            holder = None
        if holder is not None:
            if req.tag is not None and req.tag < highest:
                self.served = {t: h for t, h in served if t >= req.tag}
                self.host.world.log(f"{self.host.inc} lane {self.lane} epoch {epoch.number}: served tags "
                                    f"{sorted(self.served)} by rank {holder}")
            self.tag = highest
        else:
            try:
                self.tag = agreed_tag(req.tag, [highest, -lowest], epoch.number, self.lane)
            except Misaligned as e:
                self.host.world.log(f"{self.host.inc} lane {self.lane} epoch {epoch.number}: {e}")
                try:
                    self.state.misaligned(epoch.number, e)
                except Misaligned:
                    self._drop_group()
                    self._finish(req, e)
                    return
                self._drop_group()
                self._attempt(req, count + 1)
                return
            except FTARError as e:
                self._drop_group()
                self._finish(req, e)
                return
        self._run(req, count, epoch)

    def _run(self, req: Request, count: int, epoch: EpochView) -> None:
        group = self.group
        assert group is not None
        tag = req.tag if req.tag is not None else self.tag
        if tag in self.served:  # ``LaneEngine._take_served``: in the epoch it was computed in
            held = self.served[tag]
            value, slots = (v.value for v in held.tensors)  # type: ignore[attr-defined]
            self._done(req, tag, Result(tag, held.epoch, value, held.contributors, slots))  # type: ignore[arg-type]
            return
        token = self._arm(req, count, epoch, group, self.host.world.now, rendezvous=False)
        group.send(self.host.rid, tag, req.value if req.contribute else 0, req.slots, req.contribute,
                   lambda out: self.host.run(lambda: self._reduced(req, count, epoch, group, tag, token, out)))

    def _reduced(self, req: Request, count: int, epoch: EpochView, group: SimGroup, tag: int, token: object,
                 out: object) -> None:
        if self._token is not token or self.closed:
            return
        self._token = None
        if isinstance(out, str):
            self._fail(req, count, epoch, group, out)
            return
        assert isinstance(out, tuple)
        value, contributors, slots = out
        self._done(req, tag, Result(tag, epoch.number, value, contributors, slots))

    def _done(self, req: Request, tag: int, result: Result) -> None:
        self.held.record(tag, Held((Value(result.value), Value(result.slots)), result.epoch,  # type: ignore[arg-type]
                                   result.contributors))
        self._finish(req, result)

    def _fail(self, req: Request, count: int, epoch: EpochView, group: SimGroup, why: str,
              abandoned: bool = False) -> None:
        """``LaneEngine._exchange``'s handlers: blame (not for an abandoned collective), drop the group, then
        ``_after_failure``."""
        self.host.world.log(f"{self.host.inc} lane {self.lane} epoch {epoch.number} tag {req.tag}: {why}")
        self._token = object()  # the lane is busy blaming: no other answer is for it
        self._wait = None

        def after_failure() -> None:
            self._drop_group()
            self.state.failed(epoch.number)
            action = recovery(redo=req.redo, keep_inputs=True, direct=False)
            if action is Recovery.INTERRUPT:
                self._finish(req, self.state.interrupt(epoch.number))
                return
            self._attempt(req, count + 1)
        if abandoned:
            after_failure()
        else:  # the group of this member's failed exchange names the check-in key, as ``EpochGroup.failure_key``
            self._blame(group, epoch, group.sent_count.get(self.host.rid, 0), why, after_failure)

    def _blame(self, group: SimGroup, epoch: EpochView, key: int, why: str, then: Callable[[], None]) -> None:
        """``ftar.blame.blame_failure``: check in, report the missing early, then whom ``ftar.rules.blame`` says,
        at the end of the grace; then ``then`` (the engine's thread waits out the grace)."""
        host = self.host
        if host.can_check_in():
            group.check_in(key, host.rid)
        start = host.world.now

        def suspects() -> list[str]:
            ins = group.failures.get(key, set())
            return [r for r in epoch.replica_ids if r != host.rid and r not in ins]

        def early() -> None:
            if newer(host.current(), epoch):
                return
            s = suspects()
            if s and len(s) <= 8:
                for r in s:
                    host.report(r, epoch.number, True)

        def late() -> None:
            v = blame(epoch, host.current(), host.rid, suspects(), why)
            for r in v.suspects:
                host.report(r, epoch.number, v.early)
            self.reports.sent(v, epoch.number, host.world.now)
            if not self.closed:
                then()
        host.world.at(start + EARLY_REPORT_S, lambda: host.run(early))
        host.world.at(start + self.cfg.blame_grace_s, lambda: host.run(late))

