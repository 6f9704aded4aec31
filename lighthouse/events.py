"""What happened to the members, as structured data: the membership decision's output (``Outcome.events``, kept
on every ``Epoch`` it forms). An epoch's reason text is rendered from them here, in one place; the status view,
the page and the metrics read the events themselves, never the text.

Not to be confused with the decision's *inputs* (``lighthouse.membership.Event``: Register, Ready, Leave, Report,
Tick).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

REASON_LIMIT = 1024
"""An epoch's reason is clipped to this many characters (a burst of deaths would make it grow with the job,
and it is pushed to every member). The events themselves are never clipped."""


class DeathCause(StrEnum):
    """Why the lighthouse declared a member dead."""

    TIMEOUT = "timeout"
    """No heartbeat for ``heartbeat_timeout_s``."""
    CONFIRMED = "confirmed"
    """A failure report, confirmed at once: the suspect's last heartbeat was at least ``confirm_age_s`` old."""
    DISCONNECTED = "disconnected"
    """A failure report, confirmed at once: the suspect's own connection to the lighthouse had closed (its
    process died), so its silence need not be waited for."""
    GONE = "gone"
    """Its session closed from its end and its own catch-up endpoint then refused a connection: its process is gone
    (``lighthouse.server.probe``), so neither a report nor its silence need be waited for."""
    REPORTED = "reported"
    """Reported earlier in the epoch, then silent for ``confirm_age_s`` (confirmed at a later tick)."""
    HUNG = "hung"
    """Reported again after ``max_reforms`` re-formed epochs while still heartbeating (training is stuck), and
    singled out by the blame (``lighthouse.escalation``)."""
    STALLED = "stalled"
    """A joiner that did not turn active within ``join_deadline_s`` of entering the data plane."""
    SLOW = "slow"
    """A straggler ejected under the ``eject`` fail-slow policy (``lighthouse.ejection``): the others waited on it."""
    BLAMER = "blamer"
    """Alone, it blamed every other member of the epoch through ``max_reforms`` re-forms while nobody blamed it:
    the fault is its own, not all the others' (``lighthouse.escalation``)."""
    JOB_FINISHED = "job_finished"
    """The job finished (``State.finished_step``) and no active member is left: a member still joining has
    nothing left to join, so it is dropped at once instead of waiting for an epoch that can never form."""


@dataclass(frozen=True)
class Died:
    """A member was declared dead."""

    replica_id: str
    cause: DeathCause
    silent_s: float = 0.0
    """Seconds since its last heartbeat (TIMEOUT, CONFIRMED, REPORTED)."""
    reporters: tuple[str, ...] = ()
    """Who blamed it (CONFIRMED, REPORTED)."""
    report: str = ""
    """The reporter's words (CONFIRMED)."""
    reported_epochs: int = 0
    """HUNG: consecutive epochs it was reported in."""
    joining_s: float = 0.0
    """STALLED: seconds it spent in the data plane as a joiner."""
    step: int = 0
    """JOB_FINISHED: the step the job finished at; SLOW: the step it was first reported slow at."""
    slowdown: float = 0.0
    """SLOW: its compute over the others'."""
    waited_s: float = 0.0
    """SLOW: the others' median wait per step on it."""
    disconnected_s: float = 0.0
    """DISCONNECTED: seconds since its watch stream closed."""
    blamed: tuple[str, ...] = ()
    """BLAMER: the members it blamed."""
    kind: ClassVar[str] = "failure"


@dataclass(frozen=True)
class Restarted:
    """A new incarnation registered under a member's id: the old one is dead."""

    replica_id: str
    old_incarnation: str
    kind: ClassVar[str] = "failure"


@dataclass(frozen=True)
class Registered:
    """A replica registered, with the role it was given."""

    replica_id: str
    role: str
    reclaimed: bool = False
    """It came back with the role it held, to a lighthouse that had lost it (a restart)."""
    kind: ClassVar[str] = "join"


@dataclass(frozen=True)
class ReadyToJoin:
    """A joiner entered the data plane (it syncs state in the epoch this forms)."""

    replica_id: str
    kind: ClassVar[str] = "rejoin"


@dataclass(frozen=True)
class TurnedActive:
    """A joiner caught up and now contributes gradients."""

    replica_id: str
    kind: ClassVar[str] = "active"


@dataclass(frozen=True)
class Left:
    """A member left gracefully."""

    replica_id: str
    reason: str = ""
    kind: ClassVar[str] = "leave"


@dataclass(frozen=True)
class Finished:
    """A member left because the job completed (``Leave`` with reason ``"finished"``), at its step ``step``: the
    job is over (``State.finished_step``). Counted as a leave."""

    replica_id: str
    step: int = 0
    kind: ClassVar[str] = "leave"


MemberEvent = Died | Restarted | Registered | ReadyToJoin | TurnedActive | Left | Finished
"""An event about one replica; its class's ``kind`` is what the page and the metrics count it as: ``failure``,
``rejoin``, ``active``, ``leave`` or ``join``."""


@dataclass(frozen=True)
class Reformed:
    """The epoch was re-formed with the same members: these suspects were reported but kept heartbeating."""

    suspects: tuple[str, ...]


@dataclass(frozen=True)
class GuardHeld:
    """No epoch formed: the min-replicas guard (at least ``required`` members, one of them active) held."""

    live: int
    required: int


@dataclass(frozen=True)
class Unattributed:
    """Bounded escalation: these suspects were reported through ``max_reforms`` re-forms, but the blame does not
    single any of them out (they blame each other, and no unblamed member blames only some of them). At most one
    of them is evicted (``evicted``), none when that would break the min-replicas guard."""

    suspects: tuple[str, ...]
    evicted: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kept:
    """Bounded escalation: the blame singled out these suspects, but evicting them would break the min-replicas
    guard, so they stay (the epoch is re-formed once more)."""

    suspects: tuple[str, ...]


MembershipEvent = MemberEvent | Reformed | GuardHeld | Unattributed | Kept


def replica_kinds(events: tuple[MembershipEvent, ...]) -> list[tuple[str, str]]:
    """``(replica_id, kind)`` of each event about one replica, in order."""
    return [(e.replica_id, e.kind) for e in events if isinstance(e, MemberEvent)]


def phrase(event: MembershipEvent) -> str:
    """The words for one event in an epoch's reason."""
    match event:
        case Died(cause=DeathCause.TIMEOUT):
            return f"replica {event.replica_id} dead (no heartbeat for {event.silent_s:.2f}s)"
        case Died(cause=DeathCause.CONFIRMED):
            return (f"replica {event.replica_id} dead ({event.report}, confirmed: no heartbeat for "
                    f"{event.silent_s:.2f}s; blamed by {','.join(event.reporters)})")
        case Died(cause=DeathCause.DISCONNECTED):
            return (f"replica {event.replica_id} dead ({event.report}, confirmed: its connection closed "
                    f"{event.disconnected_s:.2f}s before; blamed by {','.join(event.reporters)})")
        case Died(cause=DeathCause.GONE):
            return (f"replica {event.replica_id} dead (its session closed and its endpoint refused a connection; "
                    f"last heartbeat {event.silent_s:.2f}s before)")
        case Died(cause=DeathCause.REPORTED):
            return (f"replica {event.replica_id} dead (reported by {','.join(event.reporters)}, no heartbeat for "
                    f"{event.silent_s:.2f}s)")
        case Died(cause=DeathCause.STALLED):
            return (f"replica {event.replica_id} dropped (joining for {event.joining_s:.0f}s in the data plane "
                    "without turning active)")
        case Died(cause=DeathCause.SLOW):
            return (f"replica {event.replica_id} ejected (slow: {event.slowdown:.2f}x the others' compute since step "
                    f"{event.step}; they waited {event.waited_s:.3f}s per step on it)")
        case Died(cause=DeathCause.BLAMER):
            return (f"replica {event.replica_id} evicted (alone, it blamed every other member ("
                    f"{','.join(event.blamed)}) in {event.reported_epochs} consecutive epochs, nobody blaming it)")
        case Died(cause=DeathCause.JOB_FINISHED):
            return f"replica {event.replica_id} dropped (the job finished at step {event.step})"
        case Died():
            return (f"replica {event.replica_id} dead (hung: reported in {event.reported_epochs} consecutive "
                    f"epochs while still heartbeating; blamed by {','.join(event.reporters) or 'nobody'})")
        case Restarted():
            return f"replica {event.replica_id} restarted (incarnation {event.old_incarnation} dead)"
        case Registered(reclaimed=True):
            return f"replica {event.replica_id} registered again as {event.role} (this lighthouse had lost it)"
        case Registered():
            return f"replica {event.replica_id} registered as {event.role}"
        case ReadyToJoin():
            return f"replica {event.replica_id} ready to join"
        case TurnedActive():
            return f"replica {event.replica_id} caught up, now active"
        case Left():
            return f"replica {event.replica_id} left" + (f": {event.reason}" if event.reason else "")
        case Finished():
            return f"replica {event.replica_id} finished the job at step {event.step}"
        case Reformed():
            return f"re-formed: {', '.join(event.suspects)} reported but still heartbeating"
        case Unattributed(evicted=()):
            return (f"blame not attributable among {', '.join(event.suspects)} (they blame each other): none "
                    "evicted (it would break the min-replicas guard)")
        case Unattributed():
            return (f"blame not attributable among {', '.join(event.suspects)} (they blame each other): only "
                    f"{', '.join(event.evicted)} evicted")
        case Kept():
            return (f"{', '.join(event.suspects)} singled out by the blame in consecutive epochs: none evicted "
                    "(it would break the min-replicas guard)")
        case GuardHeld():
            return (f"min-replicas guard: {event.live} live data-plane member(s), {event.required} required, "
                    "with at least one active; epoch unchanged")


def render_reason(events: tuple[MembershipEvent, ...]) -> str:
    """The human reason text of ``events`` ('' for none), clipped to about ``REASON_LIMIT`` characters."""
    reason = "; ".join(phrase(e) for e in events)
    if len(reason) <= REASON_LIMIT:
        return reason
    rest = reason.count("; ", REASON_LIMIT - 40) + 1
    return f"{reason[: REASON_LIMIT - 40]}… (+{rest} more)"
