"""The membership decision: ``state + event -> new state + events``, pure and without I/O.

The server (``lighthouse.server``) feeds events in one at a time and acts on the outcome (persist, push the epoch,
answer the RPC). Nothing here reads a clock or a socket: time arrives inside the events, and liveness arrives as a
mapping ``replica_id -> last heartbeat time`` that the edge keeps (heartbeats are the hot path and do not go through
the state machine). What happened comes out as structured events (``lighthouse.events``); an epoch's reason text is
rendered from them. The state's types live in ``lighthouse.model`` and are exported from here too (``from lighthouse
import membership as m``: ``m.Policy``, ``m.State``, ``m.JOINING``...).

Rules (docs/design.md §4):
- An epoch is (number, members with roles). Numbers only go up and are never reused: the next number is
  ``last_number + 1``, and ``last_number`` is durable state.
- A new epoch forms whenever the wanted membership (live members that are in the data plane) differs from the
  current epoch's, *and* the split-brain guard holds: at least ``min_replicas`` members, at least one active.
- Before the first epoch (bootstrap) registrants are active; the first epoch waits for ``expected_replicas``
  (at most ``join_window_s`` after ``min_replicas`` registered, when that is set), or without an expected count
  for ``join_window_s`` after ``min_replicas`` registered.
- After that a registrant is ``joining`` (it must fetch state; one joiner enters the data plane at a time),
  unless the job has no live active member left (everyone died: it restarts from a checkpoint as active). A
  joiner that has not turned active ``join_deadline_s`` after an epoch put it in the data plane is dropped, so it
  cannot hold the slot forever.
- A lighthouse that lost its state (a restart on the in-memory store) relearns it: before its first epoch, a
  registration that claims the role its incarnation held (``claim``, with the last epoch it saw) gets that role
  back, in the data plane; the first epoch then forms ``heartbeat_timeout_s`` after ``min_replicas`` were back
  (every live member heartbeats within that time, is told it is unknown and registers again), numbered above
  every epoch the members saw.
- An incarnation that died, left or was replaced is over for good: its calls are refused (FAILED_PRECONDITION)
  and it cannot register again (``State.departed``). A job has at most ``max_members`` replica ids registered.
- Death: no heartbeat for ``heartbeat_timeout_s``; or a failure report the lighthouse confirms, because the
  suspect's last heartbeat is older than ``confirm_age_s`` (at the report, or at a later tick), or at once
  because its own connection closed (``Report.disconnected_s``: its process died). An ``early`` report (before
  the reporter's blame grace ended) only confirms on such evidence and otherwise records nothing.
  Or, with no report, a member whose session closed from its end and whose catch-up endpoint then refused the
  lighthouse's connection (``Tick.gone``, for that incarnation only: ``lighthouse.server.probe``).
- A reported suspect that keeps heartbeating for ``confirm_age_s`` is alive: the epoch is re-formed with the
  same members (a new number), so that every member rebuilds its data plane instead of waiting forever. One
  reported again after ``max_reforms`` consecutive re-forms is hung (heartbeating, not training): dead, if the
  blame singles it out; otherwise at most one of the suspects is (bounded escalation, ``lighthouse.escalation``).
  A suspect whose heartbeats' step moved on between two reports trained in between: its re-forms start over.
- A straggler (fail-slow, policy ``eject``) leaves like a failure, when that wins (``lighthouse.ejection``).
- End of job: a member that leaves with reason ``"finished"`` marks the job completed at its step
  (``State.finished_step``, the highest if several do). From then on a registration (other than a reconnect of a
  member still in the job) changes nothing and is answered finished (``Outcome.finished_step``); once no active
  member is left, the remaining members (joiners) are dropped (``DeathCause.JOB_FINISHED``), and every call of an
  incarnation that is not a member is refused (FAILED_PRECONDITION, naming the step). The min-replicas guard no
  longer holds an epoch back: the members left only end the job (nothing trains past its last step, so nothing
  can split), and an epoch that kept a member that left would hold the others' end-of-job barrier with it until
  the barrier's bound (found by the simulator: ``fthsdp chaos --sim``). How an epoch's lanes rendezvous: ``lane_hosts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lighthouse import lane_hosts, shape, slots
from lighthouse.ejection import eject
from lighthouse.escalation import credible, deaths, hung_verdict, lone_blames
from lighthouse.events import (
    DeathCause,
    Died,
    Finished,
    GuardHeld,
    Left,
    MembershipEvent,
    ReadyToJoin,
    Reformed,
    Registered,
    Restarted,
    TurnedActive,
    render_reason,
)
from lighthouse.incarnations import Rejection as Rejection
from lighthouse.incarnations import check_incarnation as check_incarnation
from lighthouse.incarnations import departed_message as departed_message
from lighthouse.incarnations import drop
from lighthouse.incarnations import finished_message as finished_message
from lighthouse.inputs import Eject as Eject
from lighthouse.inputs import Event as Event
from lighthouse.inputs import Leave as Leave
from lighthouse.inputs import Ready as Ready
from lighthouse.inputs import Register as Register
from lighthouse.inputs import Report as Report
from lighthouse.inputs import Tick as Tick
from lighthouse.model import ACTIVE as ACTIVE
from lighthouse.model import FINISHED, HISTORY_LIMIT, ROLES, Member, holders_of
from lighthouse.model import JOINING as JOINING
from lighthouse.model import NO_SLOT as NO_SLOT
from lighthouse.model import Endpoints as Endpoints
from lighthouse.model import Epoch as Epoch
from lighthouse.model import EpochMember as EpochMember
from lighthouse.model import Policy as Policy
from lighthouse.model import State as State


@dataclass(frozen=True)
class Outcome:
    """What an event did: the new state, what happened (empty when nothing did), or why it was refused."""

    state: State
    events: tuple[MembershipEvent, ...] = ()
    rejection: Rejection | None = None
    confirmed: bool = False
    """Report only: the suspect was declared dead."""
    finished_step: int | None = None
    """Register only: the job completed at this step (``State.finished_step``), so the registrant was not
    registered (``state`` is the same object, unchanged) and must not train."""

    @property
    def reason(self) -> str:
        """``events`` as text, for people and logs ('' when nothing happened)."""
        return render_reason(self.events)

    def new_epoch(self, before: State) -> Epoch | None:
        """The epoch this outcome formed, if any."""
        if self.state.epoch is not None and self.state.epoch is not before.epoch:
            return self.state.epoch
        return None


def decide(state: State, event: Event, policy: Policy) -> Outcome:
    """Apply one event. A rejected event returns the same ``state`` object, unchanged."""
    if isinstance(event, Register):
        return _register(state, event, policy)
    if isinstance(event, Ready):
        return _ready(state, event, policy)
    if isinstance(event, Leave):
        return _leave(state, event, policy)
    if isinstance(event, Report):
        return _report(state, event, policy)
    if isinstance(event, Tick):
        return _tick(state, event, policy)
    if isinstance(event, Eject):  # a straggler (``lighthouse.ejection``)
        out = eject(state, event, policy, _reconcile)
        return Outcome(state=state, rejection=out) if isinstance(out, Rejection) else out
    raise TypeError(f"unknown event {event!r}")


def _reject(state: State, code: str, message: str) -> Outcome:
    return Outcome(state=state, rejection=Rejection(code, message))


def _register(state: State, ev: Register, policy: Policy) -> Outcome:
    if state.finished_step is not None:
        live = state.members.get(ev.replica_id)
        if live is None or live.incarnation != ev.incarnation:
            # The job completed: nobody new trains (a replica that comes back would train the last steps alone
            # from an old checkpoint). Only a reconnect of a member still in the job is answered as before.
            return Outcome(state=state, finished_step=state.finished_step)
    if (why := shape.check(state, ev.shard_count, ev.layout) or slots.check(state, ev.slot, ev.slots)) is not None:
        return _reject(state, "INVALID_ARGUMENT", why)
    if ev.claim not in ("", *ROLES):
        return _reject(state, "INVALID_ARGUMENT", f"claim must be one of {ROLES} or empty, got {ev.claim!r}")
    if state.is_departed(ev.replica_id, ev.incarnation):
        return _reject(state, "FAILED_PRECONDITION", departed_message(ev.replica_id, ev.incarnation))
    old = state.members.get(ev.replica_id)
    if old is not None and old.incarnation == ev.incarnation:
        return Outcome(state=state)  # a reconnect: idempotent
    if old is None and len(state.members) >= policy.max_members:  # silent registrations cannot grow it
        return _reject(state, "RESOURCE_EXHAUSTED", f"the job is at its limit of {policy.max_members} members")
    events: list[MembershipEvent] = []
    if old is not None:
        state = drop(state, (ev.replica_id,))
        events.append(Restarted(ev.replica_id, old.incarnation))
    members = dict(state.members)
    # A claim is honoured only before this lighthouse's first epoch, and only from a replica that trained in an
    # epoch: later, the others may have moved on without it (it gets the plain role, and its client gives up).
    reclaim = bool(ev.claim) and ev.last_epoch > 0 and state.epoch is None
    if reclaim:
        role = ev.claim
        if role == ACTIVE:
            # Registrants that were made active before any member came back trained nothing here: the returning
            # members hold the job's state, so they must catch up from them instead.
            members.update({k: dataclasses.replace(x, role=JOINING, in_epoch=False) for k, x in members.items()
                            if x.role == ACTIVE and not x.reclaimed})
    else:
        trained = state.epoch is not None or max(state.last_number, ev.last_epoch) > 0
        role = JOINING if trained and any(x.role == ACTIVE for x in members.values()) else ACTIVE
    members[ev.replica_id] = Member(ev.replica_id, ev.incarnation, ev.shard_count, ev.endpoints, role,
                                    in_epoch=reclaim or role == ACTIVE, registered_at=ev.now, reclaimed=reclaim,
                                    asks=ev.slot if ev.slots else NO_SLOT)
    events.append(Registered(ev.replica_id, role, reclaimed=reclaim))
    suspicions = {k: v for k, v in state.suspicions.items() if k != ev.replica_id}
    suspected_at = {k: v for k, v in state.suspected_at.items() if k != ev.replica_id}
    new = dataclasses.replace(state, members=members, suspicions=suspicions, suspected_at=suspected_at,
                              last_number=max(state.last_number, ev.last_epoch), slots=state.slots or ev.slots,
                              layout=state.layout or ev.layout)
    known = state.known_in_epoch_count()
    if known is not None and not reclaim:  # one member more: count on, instead of counting every member again
        new.seed_in_epoch_count(known + members[ev.replica_id].in_epoch)
    return _reconcile(new, tuple(events), ev.now, policy)


def _ready(state: State, ev: Ready, policy: Policy) -> Outcome:
    if (rej := check_incarnation(state, ev.replica_id, ev.incarnation)) is not None:
        return Outcome(state, rejection=rej)
    if ev.role not in ROLES:
        return _reject(state, "INVALID_ARGUMENT", f"role must be one of {ROLES}, got {ev.role!r}")
    member = state.members[ev.replica_id]
    if ev.role == JOINING:
        if member.in_epoch:
            return Outcome(state=state)  # already in the data plane: idempotent
        # Only a joiner that is syncing in the current epoch holds the slot: one the min-replicas guard keeps out
        # of any epoch has nothing to sync from, and turning the next one away would leave the job stuck below
        # min_replicas forever.
        syncing = state.epoch.member if state.epoch is not None else (lambda rid: None)
        busy = sorted(x.replica_id for x in state.members.values()
                      if x.role == JOINING and x.in_epoch
                      and (em := syncing(x.replica_id)) is not None and em.incarnation == x.incarnation)
        if busy:
            # One joiner at a time: a second one re-forming the epoch mid-sync would make the first start over.
            return _reject(state, "ABORTED", f"replica {busy[0]} is joining; retry once it is active")
        updated = dataclasses.replace(member, in_epoch=True)
        event: MembershipEvent = ReadyToJoin(ev.replica_id)
    else:
        if member.role == ACTIVE:
            return Outcome(state=state)
        mine = state.epoch.member(ev.replica_id) if state.epoch is not None else None
        if not member.in_epoch:
            return _reject(state, "FAILED_PRECONDITION",
                           f"replica {ev.replica_id} must take part in an epoch as joining before turning active")
        if mine is None or mine.incarnation != ev.incarnation:
            # In the data plane, but no epoch has it yet (a lighthouse that lost its state took it back before its
            # first epoch formed): the epoch is coming, so this is a retry, not a refusal for good.
            return _reject(state, "ABORTED", f"replica {ev.replica_id} is in no epoch yet; retry once it is")
        updated = dataclasses.replace(member, role=ACTIVE)
        event = TurnedActive(ev.replica_id)
    new = dataclasses.replace(state, members={**state.members, ev.replica_id: updated})
    return _reconcile(new, (event,), ev.now, policy)


def _leave(state: State, ev: Leave, policy: Policy) -> Outcome:
    if (rej := check_incarnation(state, ev.replica_id, ev.incarnation)) is not None:
        return Outcome(state, rejection=rej)
    new = drop(state, (ev.replica_id,))
    if ev.reason != FINISHED:
        return _reconcile(new, (Left(ev.replica_id, ev.reason),), ev.now, policy)
    step = ev.step if state.finished_step is None else max(state.finished_step, ev.step)
    return _reconcile(dataclasses.replace(new, finished_step=step), (Finished(ev.replica_id, ev.step),), ev.now,
                      policy)


def _report(state: State, ev: Report, policy: Policy) -> Outcome:
    if (rej := check_incarnation(state, ev.reporter, ev.reporter_incarnation)) is not None:
        return Outcome(state, rejection=rej)
    if ev.suspect == ev.reporter:
        return _reject(state, "INVALID_ARGUMENT", "a replica cannot report itself; leave instead")
    current = state.epoch.number if state.epoch is not None else 0
    if ev.epoch < current and not _dead_in_both(state, ev, policy):
        return _reject(state, "FAILED_PRECONDITION", f"stale epoch {ev.epoch}: the current epoch is {current}")
    if ev.epoch > current:
        return _reject(state, "INVALID_ARGUMENT", f"epoch {ev.epoch} does not exist yet (current {current})")
    if state.epoch is None:
        return _reject(state, "FAILED_PRECONDITION", "no epoch has formed yet: nothing to report against")
    reporter = state.epoch.member(ev.reporter)
    if reporter is None or reporter.incarnation != ev.reporter_incarnation:
        return _reject(state, "FAILED_PRECONDITION", f"reporter {ev.reporter} is not a member of epoch {current}")
    suspect = state.epoch.member(ev.suspect)
    if suspect is None:
        return _reject(state, "NOT_FOUND", f"suspect {ev.suspect} is not a member of epoch {current}")
    live = state.members.get(ev.suspect)
    if live is None or live.incarnation != suspect.incarnation:
        # Already declared dead (a restarted replica under the same id is a different member); the new epoch
        # waits on the guard.
        return Outcome(state=state, confirmed=True)
    reporters = state.suspicions.get(ev.suspect, frozenset()) | {ev.reporter}
    suspicions = {**state.suspicions, ev.suspect: reporters}
    age = ev.now - ev.last_seen.get(ev.suspect, state.members[ev.suspect].registered_at)
    why = ev.reason or "failure report"
    # Only the suspect's own evidence confirms (its silence, or its closed connection): peers' reports are not
    # votes, because a reporter cannot tell a dead peer from one that was merely slower to notice the same
    # failure (FTAR blames everyone who did not check in within its grace period).
    # ...and a lone blamer's word never confirms (its suspect's own silence or dropped connection waits for the
    # heartbeat timeout: ``lighthouse.escalation.credible``).
    if (ev.disconnected_s is None and age < policy.confirm_age_s) or \
            not credible(dataclasses.replace(state, suspicions=suspicions), ev.suspect):
        if ev.early:
            return Outcome(state=state)
        suspected_at = {**state.suspected_at, ev.suspect: state.suspected_at.get(ev.suspect, ev.now)}
        return Outcome(state=dataclasses.replace(state, suspicions=suspicions, suspected_at=suspected_at,
                                                 **_progress(state, ev)))
    new = drop(dataclasses.replace(state, suspicions=suspicions), (ev.suspect,))
    died = Died(ev.suspect, DeathCause.CONFIRMED if ev.disconnected_s is None else DeathCause.DISCONNECTED,
                silent_s=age, reporters=(ev.reporter,), report=why, disconnected_s=ev.disconnected_s or 0.0)
    return dataclasses.replace(_reconcile(new, (died,), ev.now, policy), confirmed=True)


def _progress(state: State, ev: Report) -> dict[str, Any]:
    """A suspect whose step moved on since it was last reported trained in between: the re-forms it caused so far
    were not a hang (a healthy replica blamed now and then over a slow link must never add up to one)."""
    if ev.suspect_step is None:
        return {}
    before = state.report_steps.get(ev.suspect)
    steps = {k: v for k, v in state.report_steps.items() if k in state.members}
    out: dict[str, Any] = {"report_steps": {**steps, ev.suspect: ev.suspect_step}}
    if before is not None and ev.suspect_step > before and ev.suspect in state.reforms:
        out["reforms"] = {k: v for k, v in state.reforms.items() if k != ev.suspect}
    return out


def _dead_in_both(state: State, ev: Report, policy: Policy) -> bool:
    """A report against an older epoch still counts when its suspect is a member of that epoch and of the current
    one (same incarnation) and its own evidence says it is dead (disconnected, or silent for ``confirm_age_s``): two
    replicas died at once and the report of the second arrives after the first's formed an epoch. A live
    suspect's old report stays stale (no re-form)."""
    old = next((e for e in state.history if e.number == ev.epoch), None)
    then = old.member(ev.suspect) if old is not None else None
    now = state.epoch.member(ev.suspect) if state.epoch is not None else None
    silent = ev.suspect in ev.last_seen and ev.now - ev.last_seen[ev.suspect] >= policy.confirm_age_s
    return then is not None and now is not None and then.incarnation == now.incarnation and (
        ev.disconnected_s is not None or silent)


def _tick(state: State, ev: Tick, policy: Policy) -> Outcome:
    dead: dict[str, Died] = {}
    # Only what can have changed is looked at: the members due for the timeout (every member without ``due``),
    # the suspects and the syncing joiners (a few), so that a tick costs nothing in a steady 10,000-member job.
    if ev.due is None:
        candidates: Iterable[str] = state.members
    else:
        candidates = sorted({*ev.due, *state.suspicions, *state.syncing_ids, *ev.gone} & state.members.keys())
    for rid in candidates:
        m = state.members[rid]
        age = ev.now - ev.last_seen.get(rid, m.registered_at)
        if age > policy.heartbeat_timeout_s:
            dead[rid] = Died(rid, DeathCause.TIMEOUT, silent_s=age)
        elif ev.gone.get(rid) == m.incarnation:
            dead[rid] = Died(rid, DeathCause.GONE, silent_s=age)
        elif rid in state.suspicions and rid in ev.disconnected and credible(state, rid):
            dead[rid] = Died(rid, DeathCause.DISCONNECTED, silent_s=age,
                             reporters=tuple(sorted(state.suspicions[rid])), report="failure report")
        elif rid in state.suspicions and age >= policy.confirm_age_s and credible(state, rid):
            dead[rid] = Died(rid, DeathCause.REPORTED, silent_s=age, reporters=tuple(sorted(state.suspicions[rid])))
        elif (policy.join_deadline_s and m.role == JOINING and m.syncing_since is not None
              and ev.now - m.syncing_since > policy.join_deadline_s):
            dead[rid] = Died(rid, DeathCause.STALLED, joining_s=ev.now - m.syncing_since)
    if not dead:
        # A suspect that kept heartbeating for confirm_age_s after it was reported is alive: the reporters' data
        # plane is still broken, so re-form the epoch with the same members and let everyone rebuild.
        alive = sorted(rid for rid, t in state.suspected_at.items()
                       if rid in state.members and ev.now - t >= policy.confirm_age_s)
        if alive and state.epoch is not None:
            verdict = hung_verdict(state, alive, policy)
            note: tuple[MembershipEvent, ...] = (verdict.note,) if verdict.note else ()
            if verdict.hung:
                return _reconcile(drop(state, verdict.hung), note + deaths(state, verdict, alive), ev.now, policy)
            reforms = {rid: state.reforms.get(rid, 0) + 1 for rid in alive}
            out = _reconcile(dataclasses.replace(state, reforms=reforms, lone_blames=lone_blames(state)),
                             (Reformed(tuple(alive)), *note), ev.now, policy, force=True)
            # The min-replicas guard held: no epoch was re-formed, so none counts towards a hung verdict (at one
            # tick every 50 ms, three would have in 0.15 s); the next tick tries again.
            return out if out.new_epoch(state) is not None else Outcome(state=state)
        # Only bootstrap waits on time alone (the join window); otherwise nothing changed.
        return _reconcile(state, (), ev.now, policy) if state.epoch is None else Outcome(state=state)
    return _reconcile(drop(state, dead), tuple(dead.values()), ev.now, policy)


def _wanted(state: State) -> tuple[EpochMember, ...]:
    return tuple(m.listed for m in sorted(state.members.values(), key=lambda m: m.replica_id) if m.in_epoch)


def _reconcile(state: State, events: tuple[MembershipEvent, ...], now: float, policy: Policy,
               force: bool = False) -> Outcome:
    """Form a new epoch if the wanted membership differs from the current one (or ``force``) and the guards
    allow it. In a finished job without a live active member, drop the members left instead."""
    if state.finished_step is not None:
        if state.members and not any(x.role == ACTIVE for x in state.members.values()):
            # Nothing left to join or to catch up from: the joiners in flight are told at once (their calls are
            # refused), instead of waiting for an epoch that can never form.
            gone = sorted(state.members)
            events = (*events, *(Died(rid, DeathCause.JOB_FINISHED, step=state.finished_step) for rid in gone))
            state = drop(state, gone)
        if not state.members:
            return Outcome(state=state, events=events)  # the job is over: no epoch, and no guard to report
    if state.epoch is None:
        # Bootstrap: wait for the expected count, or for the join window after min_replicas. (Counted without
        # building the member list: registrations arrive one by one, and a thousand would make it quadratic.)
        count = state.in_epoch_count
        min_reached_at = state.min_reached_at
        if count >= policy.min_replicas:
            min_reached_at = min_reached_at if min_reached_at is not None else now
        else:
            min_reached_at = None
        if min_reached_at != state.min_reached_at:
            state = dataclasses.replace(state, min_reached_at=min_reached_at)
        # With an expected count the window bounds the wait for stragglers (0: for all); without one, the first
        # epoch forms join_window_s after min_replicas. Relearning, it waits a heartbeat timeout for the others.
        window = max(policy.join_window_s, policy.heartbeat_timeout_s) if state.last_number else policy.join_window_s
        full = bool(policy.expected_replicas) and count >= policy.expected_replicas
        window_over = (min_reached_at is not None and now - min_reached_at >= window
                       and (window > 0 or not policy.expected_replicas))
        if not (full or window_over):
            return Outcome(state=state, events=events)
    state = slots.assign(state)  # a free slot (its holder died) goes to a spare at once
    wanted = _wanted(state)
    if (state.epoch is not None and not force and len(wanted) == len(state.epoch.members)
            and tuple((m.replica_id, m.incarnation, m.role, m.slot) for m in wanted) == state.epoch.key()):
        return Outcome(state=state, events=events)
    if (len(wanted) < policy.min_replicas and state.finished_step is None) or not any(m.role == ACTIVE for m in wanted):
        return Outcome(state=state, events=(*events, GuardHeld(len(wanted), policy.min_replicas)))
    number = state.last_number + 1
    keeps = (state.epoch is not None and not force
             and tuple((m.replica_id, m.incarnation) for m in wanted) == state.epoch.plane_key()
             and (not policy.orphan_planes or holders_of(wanted) == state.epoch.holders_key()))
    epoch = Epoch(number=number, members=wanted, created_at=now, reason=render_reason(events) or "bootstrap",
                  plane=state.epoch.data_plane if keeps and state.epoch is not None else number, events=events,
                  hosting=lane_hosts.mode(state.epoch, wanted, force))
    history = (state.history + (epoch,))[-HISTORY_LIMIT:]
    members = state.members
    syncing = {x.replica_id: dataclasses.replace(members[x.replica_id], syncing_since=now) for x in wanted
               if x.role == JOINING and members[x.replica_id].syncing_since is None}
    new = dataclasses.replace(state, epoch=epoch, last_number=epoch.number, history=history, suspicions={},
                              suspected_at={}, reforms=state.reforms if force else {},
                              lone_blames={k: v for k, v in state.lone_blames.items() if k in state.members},
                              members={**members, **syncing} if syncing else members)
    return Outcome(state=new, events=events)
