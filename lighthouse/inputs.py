"""The events the membership decision takes (``lighthouse.membership.decide``); time and liveness arrive inside
them, so the decision reads no clock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lighthouse.ejection import Eject as Eject
from lighthouse.model import NO_SLOT, Endpoints


@dataclass(frozen=True)
class Register:
    replica_id: str
    incarnation: str
    shard_count: int
    endpoints: Endpoints
    now: float
    claim: str = ""
    """Re-registering with a lighthouse that lost this incarnation: the role it held (``JOINING``: syncing in the
    data plane); '' for a plain registration."""
    last_epoch: int = 0
    """The newest epoch this replica saw: numbering goes on above it."""
    slot: int = NO_SLOT
    """The data slot it asks for (``lighthouse.slots``): its ``FTHSDP_REPLICA_INDEX``, or the slot it held, when
    registering again; ``NO_SLOT``: none (a spare)."""
    slots: int = 0
    """The job's data slots as this replica knows them (``FTHSDP_NUM_REPLICAS``); 0: it names none."""
    layout: str = ""
    """The replica's parallel layout as its device mesh names it (``dp2xtp2``); '' : it names none."""


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
    step: int = 0
    """The leaver's last committed step; with reason ``FINISHED`` ("finished"), the step the job completed at."""


@dataclass(frozen=True)
class Report:
    reporter: str
    reporter_incarnation: str
    suspect: str
    epoch: int
    reason: str
    now: float
    last_seen: Mapping[str, float]
    disconnected_s: float | None = None
    """Seconds since a watch stream of the suspect's current incarnation closed from its end without being
    replaced (the edge knows its streams); ``None`` while every stream it opened is open."""
    early: bool = False
    """Sent before the reporter's blame grace ended, while live peers may still be checking in: confirmed only on
    evidence (disconnected, or silent for ``confirm_age_s``), else it changes nothing."""
    suspect_step: int | None = None
    """The step the suspect's heartbeats last carried (the edge knows it; None: unknown): progress since its
    previous report clears its re-forms (it trains: not hung)."""


@dataclass(frozen=True)
class Tick:
    now: float
    last_seen: Mapping[str, float]
    due: frozenset[str] | None = None
    """The members whose heartbeat timeout may have passed (the edge keeps their deadlines in a heap,
    ``lighthouse.liveness``): only they are checked for it. None: every member is (the pure default)."""
    disconnected: frozenset[str] = frozenset()
    """Reported suspects whose connection to the lighthouse has just closed from their end (their process died):
    confirmed dead at once, as a report that found the connection closed is."""
    gone: Mapping[str, str] = field(default_factory=dict)
    """Members (id -> incarnation) whose session closed from their end and whose own catch-up endpoint then refused
    a connection: their process is gone, so they are dead with no report (``lighthouse.server.probe``). An entry whose
    incarnation is no longer the member's changes nothing."""


Event = Register | Ready | Leave | Report | Tick | Eject
