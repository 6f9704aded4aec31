"""The membership state the decision works on (``lighthouse.membership``): roles, the policy, members, epochs.
Plain frozen dataclasses, no behaviour beyond lookups."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lighthouse.events import MembershipEvent

ACTIVE = "active"
JOINING = "joining"
ROLES = (ACTIVE, JOINING)
NO_SLOT = -1
"""A member that trains no data slot: a spare (``lighthouse.slots``)."""


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
    declared dead (hung: its heartbeat thread lives, its training does not). 0: never. Only the suspects the blame
    singles out are: see ``lighthouse.escalation``."""
    join_deadline_s: float = 300.0
    """A joiner that has not turned active this long after an epoch first put it in the data plane is dropped
    (declared dead), so that a lost ``Ready(ACTIVE)`` or a stuck catch-up cannot hold the one-joiner slot
    forever. 0: never."""
    straggler_factor: float = 1.5
    """A member whose compute per step is at least this many times the others' is a straggler (once confirmed:
    ``lighthouse.stragglers``). 1.5: with three replicas, ejecting one that slow would win back what it costs."""
    straggler_confirm: int = 3
    """Consecutive slow reports (of distinct steps) before a member is named a straggler."""
    max_members: int = 4096
    """Registered replica groups per job, at most: one more with a new replica id is refused (RESOURCE_EXHAUSTED),
    so registrations that go silent cannot grow a job's state without bound (they are dropped at their heartbeat
    timeout, and remembered among the ``DEPARTED_IDS_LIMIT`` departed)."""
    straggler_policy: str = "report"
    """What a straggler gets: ``report`` (named in the status) or ``eject`` (taken out of the job when that wins:
    ``lighthouse.ejection``; it comes back once a probe step shows it healthy)."""
    orphan_planes: bool = False
    """Orphan slots carried (docs/design.md §7; so far the simulator's ``--sim-orphans``): a change of which active
    members hold which slot (a joiner turned active, a spare handed a slot) starts a new data plane, so that every
    member of a group deals the orphans' micro-batches from the same holders (``fthsdp.runtime.orphans``)."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if not 0 < self.confirm_age_s <= self.heartbeat_timeout_s:
            raise ValueError("need 0 < confirm_age_s <= heartbeat_timeout_s")
        if self.max_members < 1:
            raise ValueError(f"max_members must be >= 1, got {self.max_members}")
        if min(self.join_window_s, self.expected_replicas, self.max_reforms, self.join_deadline_s) < 0:
            raise ValueError("join_window_s, expected_replicas, max_reforms and join_deadline_s must be >= 0")
        if not self.straggler_factor > 1.0 or self.straggler_confirm < 1:
            raise ValueError("need straggler_factor > 1 and straggler_confirm >= 1")
        if self.straggler_policy not in ("report", "eject"):
            raise ValueError(f"straggler_policy must be report or eject, got {self.straggler_policy!r}")


@dataclass(frozen=True)
class Endpoints:
    """Where a replica can be reached (``host:port``; empty: not offered)."""

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
    syncing_since: float | None = None
    """A joiner: when the first epoch that has it in the data plane formed (None: not in one yet)."""
    reclaimed: bool = False
    """Re-registered with the role it held, to a lighthouse that had lost it (a restart without a durable store);
    only meaningful before this lighthouse's first epoch."""
    slot: int = NO_SLOT
    """The data slot this member trains (``lighthouse.slots``); ``NO_SLOT``: none, a spare."""
    asks: int = NO_SLOT
    """The slot it asked for at registration (its ``FTHSDP_REPLICA_INDEX``; ``NO_SLOT``: none)."""

    @functools.cached_property
    def listed(self) -> EpochMember:
        """This member as an epoch lists it: one object for as long as the member is unchanged, so that epochs
        share their unchanged members (and what is built from them, such as their encodings, is built once)."""
        return EpochMember(self.replica_id, self.incarnation, self.role, self.shard_count, self.endpoints, self.slot)


@dataclass(frozen=True)
class EpochMember:
    """A member as an epoch lists it."""

    replica_id: str
    incarnation: str
    role: str
    shard_count: int
    endpoints: Endpoints
    slot: int = NO_SLOT
    """The data slot it trains in this epoch; ``NO_SLOT``: none (a spare: it exchanges zeros, applies the update)."""

    @property
    def spare(self) -> bool:
        return self.slot == NO_SLOT


@dataclass(frozen=True)
class Epoch:
    """One membership epoch: numbers only go up and are never reused."""

    number: int
    members: tuple[EpochMember, ...]
    created_at: float
    reason: str
    """What formed it, for people: rendered from ``events`` (``lighthouse.events.render_reason``)."""
    plane: int = 0
    """The epoch whose data-plane groups this one keeps (0: its own). Only a role change keeps them: the same
    members with the same incarnations; a re-formed epoch (a suspected broken group) never does."""
    events: tuple[MembershipEvent, ...] = ()
    """What happened to the members to form it (none for a bootstrap epoch formed by the join window)."""
    hosting: str = ""
    """How its lanes rendezvous (``lighthouse.lane_hosts.mode``): on stores their members host (``members``,
    ``announced``) or on the lighthouse's (``''``, the default of an epoch stored before member hosting)."""

    @property
    def data_plane(self) -> int:
        return self.plane or self.number

    def plane_key(self) -> tuple[tuple[str, str], ...]:
        return tuple((m.replica_id, m.incarnation) for m in self.members)

    def holders_key(self) -> tuple[tuple[str, int], ...]:
        """Which active members hold which slot (``Policy.orphan_planes``)."""
        return holders_of(self.members)

    @functools.cached_property
    def _key(self) -> tuple[tuple[str, str, str, int], ...]:
        return tuple((m.replica_id, m.incarnation, m.role, m.slot) for m in self.members)

    def key(self) -> tuple[tuple[str, str, str, int], ...]:
        """Who is in it, in which role, training which slot: an epoch forms when this would change."""
        return self._key

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
    """suspect replica id -> consecutive epochs re-formed because of it (reset once it is seen training)."""
    lone_blames: Mapping[str, int] = field(default_factory=dict)
    """reporter id -> consecutive re-formed epochs in which it, blamed by nobody, blamed every other member
    (``lighthouse.escalation``): counted whatever the blamed members' steps do; kept across an epoch that changes
    the members, ended by a re-form in which it did not."""
    report_steps: Mapping[str, int] = field(default_factory=dict)
    """suspect replica id -> the step its heartbeats had reached when it was last reported: a suspect whose step
    moved on between two reports trained in between, so it is not hung, whatever its re-forms so far."""
    min_reached_at: float | None = None
    """Bootstrap: when ``min_replicas`` registrations were first reached."""
    departed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """replica id -> its last ``DEPARTED_LIMIT`` incarnations that died, left or were replaced, oldest first, for the
    ``DEPARTED_IDS_LIMIT`` replica ids that departed most recently (in that order):
    they are over for good (their calls are answered FAILED_PRECONDITION, never 'register again'). Durable
    (``lighthouse.state_doc``)."""
    finished_step: int | None = None
    """The job completed at this step: a member left with reason ``"finished"`` (the highest step, if several
    did). None: not finished. Durable. From then on nobody registers (``Outcome.finished_step``), and once no
    active member is left the remaining members are dropped (``DeathCause.JOB_FINISHED``)."""
    slots: int = 0
    """The job's data slots (``FTHSDP_NUM_REPLICAS``), from its first registration that named them; 0: none named
    (no slot is handed out: ``lighthouse.slots``). Durable."""
    layout: str = ""
    """The job's replica layout (``dp2xtp2``: a replica's mesh, by dimension), from its first registration that
    named one; a registration naming another is refused. '' : none named. Durable."""

    @functools.cached_property
    def in_epoch_count(self) -> int:
        """Members in the data plane (the bootstrap waits for enough). Computed once per state object; a
        registration seeds its successor's (``seed_in_epoch_count``), so a bootstrap of N registrations is O(N),
        not O(N^2)."""
        return sum(1 for m in self.members.values() if m.in_epoch)

    @functools.cached_property
    def syncing_ids(self) -> frozenset[str]:
        """Joiners in the data plane that have not turned active (their join deadline runs). Once per state object:
        a tick (20 a second) looks at these, not at every member."""
        return frozenset(rid for rid, m in self.members.items() if m.syncing_since is not None and m.role == JOINING)

    def seed_in_epoch_count(self, value: int) -> None:
        """Set ``in_epoch_count`` of a state just built from another whose count is known (one member more or
        less), instead of counting again. The caller vouches for ``value``."""
        self.__dict__["in_epoch_count"] = value

    def known_in_epoch_count(self) -> int | None:
        """``in_epoch_count`` if it was computed or seeded already, else None (never computes)."""
        return self.__dict__.get("in_epoch_count")

    def is_departed(self, replica_id: str, incarnation: str) -> bool:
        """Whether ``incarnation`` of ``replica_id`` died, left or was replaced (as far as this state remembers)."""
        return incarnation in self.departed.get(replica_id, ())


FINISHED = "finished"
"""The ``Leave`` reason that means the job completed (at the leaver's ``step``)."""
HISTORY_LIMIT = 256
"""Epochs kept in the live state's history."""
DEPARTED_LIMIT = 8
"""Incarnations remembered as over, per replica id (``State.departed``)."""
DEPARTED_IDS_LIMIT = 2048
"""Replica ids remembered in ``State.departed``, the most recently departed: the durable document stays far
below etcd's 1.5 MiB request limit (about 2,000 ids of 8 incarnations) however many registrations go silent."""


def holders_of(members: Iterable[EpochMember]) -> tuple[tuple[str, int], ...]:
    """The active members of ``members`` that hold a data slot, with their slots, in order."""
    return tuple((m.replica_id, m.slot) for m in members if m.role == ACTIVE and m.slot != NO_SLOT)
