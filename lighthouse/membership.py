"""The membership decision: ``state + event -> new state + reason``, pure and without I/O.

The server (``lighthouse.server``) feeds events in one at a time and acts on the outcome (persist, push the
epoch, answer the RPC). Nothing here reads a clock or a socket: time arrives inside the events, and liveness
arrives as a mapping ``replica_id -> last heartbeat time`` that the edge keeps (heartbeats are the hot path and
do not go through the state machine).

Rules (DESIGN §4):
- An epoch is (number, members with roles). Numbers only go up and are never reused: the next number is
  ``last_number + 1``, and ``last_number`` is durable state.
- A new epoch forms whenever the wanted membership (live members that are in the data plane) differs from the
  current epoch's, *and* the split-brain guard holds: at least ``min_replicas`` members, at least one active.
- Before the first epoch (bootstrap) registrants are active; the first epoch waits for ``expected_replicas``
  (at most ``join_window_s`` after ``min_replicas`` registered, when that is set), or without an expected count
  for ``join_window_s`` after ``min_replicas`` registered.
- After that a registrant is ``joining`` (it must fetch state; one joiner enters the data plane at a time),
  unless the job has no live active member left
  (everyone died: it restarts from a checkpoint as active).
- Death: no heartbeat for ``heartbeat_timeout_s``; or a failure report the lighthouse confirms, because the
  suspect's last heartbeat is older than ``confirm_age_s`` (at the report, or at a later tick).
- A reported suspect that keeps heartbeating for ``confirm_age_s`` is alive: the epoch is re-formed with the
  same members (a new number), so that every member rebuilds its data plane instead of waiting forever. One
  reported again after ``max_reforms`` consecutive re-forms is hung (heartbeating, not training): dead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

ACTIVE = "active"
JOINING = "joining"
ROLES = (ACTIVE, JOINING)


@dataclass(frozen=True)
class Policy:
    """Lighthouse settings that the decision depends on."""

    min_replicas: int = 1
    """Split-brain guard: no epoch with fewer members than this."""
    heartbeat_interval_s: float = 0.5
    """Advertised to clients: how often to heartbeat."""
    heartbeat_timeout_s: float = 3.0
    """A member with no heartbeat for this long is dead."""
    confirm_age_s: float = 1.0
    """A reported suspect whose last heartbeat is at least this old is confirmed dead."""
    join_window_s: float = 0.0
    """Bootstrap: after ``min_replicas`` registered, wait this long for more before forming the first epoch
    (with ``expected_replicas`` set: at most this long for the expected count; 0 then waits for all of them)."""
    expected_replicas: int = 0
    """Bootstrap: form the first epoch as soon as this many registered (0: unknown)."""
    max_reforms: int = 2
    """A suspect that keeps heartbeating yet is reported again after this many consecutive re-formed epochs is
    declared dead (hung: its heartbeat thread lives, its training does not). 0: never."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if not 0 < self.confirm_age_s <= self.heartbeat_timeout_s:
            raise ValueError("need 0 < confirm_age_s <= heartbeat_timeout_s")
        if self.join_window_s < 0 or self.expected_replicas < 0 or self.max_reforms < 0:
            raise ValueError("join_window_s, expected_replicas and max_reforms must be >= 0")


@dataclass(frozen=True)
class Endpoints:
    data_plane: str = ""
    catchup: str = ""
    http: str = ""


@dataclass(frozen=True)
class Member:
    """A registered, live replica."""

    replica_id: str
    incarnation: str
    shard_count: int
    endpoints: Endpoints
    role: str
    in_epoch: bool
    registered_at: float
    step: int = 0


@dataclass(frozen=True)
class EpochMember:
    replica_id: str
    incarnation: str
    role: str
    shard_count: int
    endpoints: Endpoints


@dataclass(frozen=True)
class Epoch:
    number: int
    members: tuple[EpochMember, ...]
    created_at: float
    reason: str
    plane: int = 0
    """The epoch whose data-plane groups this one keeps (0: its own). Only a role change keeps them: the same
    members with the same incarnations; a re-formed epoch (a suspected broken group) never does."""

    @property
    def data_plane(self) -> int:
        return self.plane or self.number

    def plane_key(self) -> tuple[tuple[str, str], ...]:
        return tuple((m.replica_id, m.incarnation) for m in self.members)

    def key(self) -> tuple[tuple[str, str, str], ...]:
        return tuple((m.replica_id, m.incarnation, m.role) for m in self.members)

    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    def member(self, replica_id: str) -> EpochMember | None:
        for m in self.members:
            if m.replica_id == replica_id:
                return m
        return None


@dataclass(frozen=True)
class State:
    """Everything the decision needs. ``members`` holds live registrations only; the dead are dropped."""

    members: Mapping[str, Member] = field(default_factory=dict)
    epoch: Epoch | None = None
    last_number: int = 0
    history: tuple[Epoch, ...] = ()
    suspicions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """suspect replica id -> reporters, within the current epoch."""
    suspected_at: Mapping[str, float] = field(default_factory=dict)
    """suspect replica id -> time of its first report in the current epoch."""
    reforms: Mapping[str, int] = field(default_factory=dict)
    """suspect replica id -> consecutive epochs re-formed because of it."""
    min_reached_at: float | None = None
    """Bootstrap: when ``min_replicas`` registrations were first reached."""


# --- events -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Register:
    replica_id: str
    incarnation: str
    shard_count: int
    endpoints: Endpoints
    now: float


@dataclass(frozen=True)
class Ready:
    replica_id: str
    incarnation: str
    role: str
    now: float


@dataclass(frozen=True)
class Leave:
    replica_id: str
    incarnation: str
    reason: str
    now: float


@dataclass(frozen=True)
class Report:
    reporter: str
    reporter_incarnation: str
    suspect: str
    epoch: int
    reason: str
    now: float
    last_seen: Mapping[str, float]


@dataclass(frozen=True)
class Tick:
    now: float
    last_seen: Mapping[str, float]


Event = Register | Ready | Leave | Report | Tick


@dataclass(frozen=True)
class Rejection:
    """Why an event was refused; ``code`` names the gRPC status the edge answers with."""

    code: str  # INVALID_ARGUMENT | NOT_FOUND | FAILED_PRECONDITION | ABORTED (retry later)
    message: str


@dataclass(frozen=True)
class Outcome:
    state: State
    reason: str = ""
    """What changed (empty when nothing did)."""
    rejection: Rejection | None = None
    confirmed: bool = False
    """Report only: the suspect was declared dead."""

    def new_epoch(self, before: State) -> Epoch | None:
        """The epoch this outcome formed, if any."""
        if self.state.epoch is not None and self.state.epoch is not before.epoch:
            return self.state.epoch
        return None


HISTORY_LIMIT = 256
REASON_LIMIT = 1024
"""An epoch's reason is clipped to this many characters (a burst of deaths would make it grow with the job,
and it is pushed to every member and kept in the history)."""


def _clip(reason: str) -> str:
    if len(reason) <= REASON_LIMIT:
        return reason
    rest = reason.count("; ", REASON_LIMIT - 40) + 1
    return f"{reason[: REASON_LIMIT - 40]}… (+{rest} more)"


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
    raise TypeError(f"unknown event {event!r}")


def _reject(state: State, code: str, message: str) -> Outcome:
    return Outcome(state=state, rejection=Rejection(code, message))


def _check_incarnation(state: State, replica_id: str, incarnation: str) -> Rejection | None:
    member = state.members.get(replica_id)
    if member is None:
        return Rejection("NOT_FOUND", f"replica {replica_id!r} is not registered (or was declared dead)")
    if member.incarnation != incarnation:
        return Rejection("FAILED_PRECONDITION",
                         f"replica {replica_id!r} incarnation {incarnation!r} was replaced by {member.incarnation!r}")
    return None


def _register(state: State, ev: Register, policy: Policy) -> Outcome:
    job_shards = next(iter(state.members.values())).shard_count if state.members else None
    if job_shards is not None and ev.shard_count != job_shards:
        return _reject(state, "INVALID_ARGUMENT",
                       f"shard_count {ev.shard_count} differs from the job's {job_shards}")
    old = state.members.get(ev.replica_id)
    if old is not None and old.incarnation == ev.incarnation:
        return Outcome(state=state)  # a reconnect: idempotent
    members = dict(state.members)
    reasons = []
    if old is not None:
        del members[ev.replica_id]
        reasons.append(f"replica {ev.replica_id} restarted (incarnation {old.incarnation} dead)")
    bootstrap = state.epoch is None
    any_active = any(m.role == ACTIVE for m in members.values())
    role = ACTIVE if (bootstrap or not any_active) else JOINING
    members[ev.replica_id] = Member(ev.replica_id, ev.incarnation, ev.shard_count, ev.endpoints, role,
                                    in_epoch=(role == ACTIVE), registered_at=ev.now)
    reasons.append(f"replica {ev.replica_id} registered as {role}")
    suspicions = {k: v for k, v in state.suspicions.items() if k != ev.replica_id}
    suspected_at = {k: v for k, v in state.suspected_at.items() if k != ev.replica_id}
    new = dataclasses.replace(state, members=members, suspicions=suspicions, suspected_at=suspected_at)
    return _reconcile(new, "; ".join(reasons), ev.now, policy)


def _ready(state: State, ev: Ready, policy: Policy) -> Outcome:
    if (rej := _check_incarnation(state, ev.replica_id, ev.incarnation)) is not None:
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
        reason = f"replica {ev.replica_id} ready to join"
    else:
        if member.role == ACTIVE:
            return Outcome(state=state)
        mine = state.epoch.member(ev.replica_id) if state.epoch is not None else None
        if not member.in_epoch or mine is None or mine.incarnation != ev.incarnation:
            return _reject(state, "FAILED_PRECONDITION",
                           f"replica {ev.replica_id} must take part in an epoch as joining before turning active")
        updated = dataclasses.replace(member, role=ACTIVE)
        reason = f"replica {ev.replica_id} caught up, now active"
    new = dataclasses.replace(state, members={**state.members, ev.replica_id: updated})
    return _reconcile(new, reason, ev.now, policy)


def _leave(state: State, ev: Leave, policy: Policy) -> Outcome:
    if (rej := _check_incarnation(state, ev.replica_id, ev.incarnation)) is not None:
        return Outcome(state, rejection=rej)
    members = {k: v for k, v in state.members.items() if k != ev.replica_id}
    new = dataclasses.replace(state, members=members)
    why = f": {ev.reason}" if ev.reason else ""
    return _reconcile(new, f"replica {ev.replica_id} left{why}", ev.now, policy)


def _report(state: State, ev: Report, policy: Policy) -> Outcome:
    if (rej := _check_incarnation(state, ev.reporter, ev.reporter_incarnation)) is not None:
        return Outcome(state, rejection=rej)
    if ev.suspect == ev.reporter:
        return _reject(state, "INVALID_ARGUMENT", "a replica cannot report itself; leave instead")
    current = state.epoch.number if state.epoch is not None else 0
    if ev.epoch < current:
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
    # Only the suspect's own silence confirms: peers' reports are not votes, because a reporter cannot tell a
    # dead peer from one that was merely slower to notice the same failure (FTAR blames everyone who did not
    # check in within its grace period).
    if age < policy.confirm_age_s:
        suspected_at = {**state.suspected_at, ev.suspect: state.suspected_at.get(ev.suspect, ev.now)}
        return Outcome(state=dataclasses.replace(state, suspicions=suspicions, suspected_at=suspected_at))
    cause = f"{why}, confirmed: no heartbeat for {age:.2f}s"
    members = {k: v for k, v in state.members.items() if k != ev.suspect}
    new = dataclasses.replace(state, members=members, suspicions=suspicions)
    out = _reconcile(new, f"replica {ev.suspect} dead ({cause}; blamed by {ev.reporter})", ev.now, policy)
    return dataclasses.replace(out, confirmed=True)


def _tick(state: State, ev: Tick, policy: Policy) -> Outcome:
    dead: dict[str, str] = {}
    for rid, m in state.members.items():
        age = ev.now - ev.last_seen.get(rid, m.registered_at)
        if age > policy.heartbeat_timeout_s:
            dead[rid] = f"replica {rid} dead (no heartbeat for {age:.2f}s)"
        elif rid in state.suspicions and age >= policy.confirm_age_s:
            dead[rid] = (f"replica {rid} dead (reported by {','.join(sorted(state.suspicions[rid]))}, "
                         f"no heartbeat for {age:.2f}s)")
    if not dead:
        # A suspect that kept heartbeating for confirm_age_s after it was reported is alive: the reporters' data
        # plane is still broken, so re-form the epoch with the same members and let everyone rebuild.
        alive = sorted(rid for rid, t in state.suspected_at.items()
                       if rid in state.members and ev.now - t >= policy.confirm_age_s)
        if alive and state.epoch is not None:
            hung = [rid for rid in alive if policy.max_reforms and state.reforms.get(rid, 0) >= policy.max_reforms]
            if hung:
                members = {k: v for k, v in state.members.items() if k not in hung}
                reason = "; ".join(f"replica {rid} dead (hung: reported in {state.reforms[rid] + 1} consecutive "
                                   "epochs while still heartbeating)" for rid in hung)
                return _reconcile(dataclasses.replace(state, members=members), reason, ev.now, policy)
            reforms = {rid: state.reforms.get(rid, 0) + 1 for rid in alive}
            return _reconcile(dataclasses.replace(state, reforms=reforms),
                              f"re-formed: {', '.join(alive)} reported but still heartbeating", ev.now, policy,
                              force=True)
        # Only bootstrap waits on time alone (the join window); otherwise nothing changed.
        return _reconcile(state, "", ev.now, policy) if state.epoch is None else Outcome(state=state)
    members = {k: v for k, v in state.members.items() if k not in dead}
    new = dataclasses.replace(state, members=members)
    return _reconcile(new, "; ".join(dead.values()), ev.now, policy)


def _wanted(state: State) -> tuple[EpochMember, ...]:
    return tuple(
        EpochMember(m.replica_id, m.incarnation, m.role, m.shard_count, m.endpoints)
        for m in sorted(state.members.values(), key=lambda m: m.replica_id)
        if m.in_epoch
    )


def _reconcile(state: State, reason: str, now: float, policy: Policy, force: bool = False) -> Outcome:
    """Form a new epoch if the wanted membership differs from the current one (or ``force``) and the guards
    allow it."""
    if state.epoch is None:
        # Bootstrap: wait for the expected count, or for the join window after min_replicas. (Counted without
        # building the member list: registrations arrive one by one, and a thousand would make it quadratic.)
        count = sum(1 for m in state.members.values() if m.in_epoch)
        min_reached_at = state.min_reached_at
        if count >= policy.min_replicas:
            min_reached_at = min_reached_at if min_reached_at is not None else now
        else:
            min_reached_at = None
        if min_reached_at != state.min_reached_at:
            state = dataclasses.replace(state, min_reached_at=min_reached_at)
        # With an expected count the window bounds the wait for stragglers (0: wait for all of them);
        # without one, the first epoch forms join_window_s after min_replicas registered.
        full = bool(policy.expected_replicas) and count >= policy.expected_replicas
        window_over = (min_reached_at is not None and now - min_reached_at >= policy.join_window_s
                       and (policy.join_window_s > 0 or not policy.expected_replicas))
        if not (full or window_over):
            return Outcome(state=state, reason=reason)
    wanted = _wanted(state)
    key = tuple((m.replica_id, m.incarnation, m.role) for m in wanted)
    if state.epoch is not None and key == state.epoch.key() and not force:
        return Outcome(state=state, reason=reason)
    if len(wanted) < policy.min_replicas or not any(m.role == ACTIVE for m in wanted):
        guard = (f"min-replicas guard: {len(wanted)} live data-plane member(s), "
                 f"{policy.min_replicas} required, with at least one active; epoch unchanged")
        return Outcome(state=state, reason=f"{reason}; {guard}" if reason else guard)
    number = state.last_number + 1
    keeps = (state.epoch is not None and not force
             and tuple((m.replica_id, m.incarnation) for m in wanted) == state.epoch.plane_key())
    epoch = Epoch(number=number, members=wanted, created_at=now, reason=_clip(reason) if reason else "bootstrap",
                  plane=state.epoch.data_plane if keeps and state.epoch is not None else number)
    history = (state.history + (epoch,))[-HISTORY_LIMIT:]
    new = dataclasses.replace(state, epoch=epoch, last_number=epoch.number, history=history, suspicions={},
                              suspected_at={}, reforms=state.reforms if force else {})
    return Outcome(state=new, reason=epoch.reason)
