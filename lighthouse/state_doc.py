"""The store's JSON document of a job: the durable part of the membership state, and back. Pure functions."""

from __future__ import annotations

import dataclasses
from typing import Any

from lighthouse import lane_hosts
from lighthouse.events import (
    DeathCause,
    Died,
    Finished,
    GuardHeld,
    Kept,
    Left,
    MembershipEvent,
    ReadyToJoin,
    Reformed,
    Registered,
    Restarted,
    TurnedActive,
    Unattributed,
)
from lighthouse.model import JOINING, NO_SLOT, Endpoints, Epoch, EpochMember, Member, State

DOC_HISTORY_LIMIT = 16
"""Epochs of history kept in the stored document (the live state keeps ``model.HISTORY_LIMIT``). The document
is written on every epoch change, on the lighthouse's event loop, so it must stay small."""
DOC_EVENTS_LIMIT = 64
"""Events kept per epoch in the stored document (a burst of deaths in a large job must not make every write
huge; the live state keeps them all, and the stored reason text names the rest)."""

_EVENT_TYPES: dict[str, type[MembershipEvent]] = {
    "died": Died, "restarted": Restarted, "registered": Registered, "ready_to_join": ReadyToJoin,
    "turned_active": TurnedActive, "left": Left, "reformed": Reformed, "guard_held": GuardHeld,
    "unattributed": Unattributed, "finished": Finished, "kept": Kept,
}
_EVENT_NAMES = {cls: name for name, cls in _EVENT_TYPES.items()}


def _endpoints_to_doc(e: Endpoints) -> dict[str, str]:
    return {"data_plane": e.data_plane, "catchup": e.catchup, "http": e.http}


def event_to_doc(e: MembershipEvent) -> list[Any]:
    """An event as compact JSON: its type's name, then its fields in order (tuples as lists)."""
    values = (getattr(e, f.name) for f in dataclasses.fields(e))
    return [_EVENT_NAMES[type(e)], *(list(v) if isinstance(v, tuple) else v for v in values)]


def event_from_doc(d: list[Any]) -> MembershipEvent:
    """The event ``event_to_doc`` wrote."""
    name, *values = d
    cls = _EVENT_TYPES[name]
    args: list[Any] = [tuple(v) if isinstance(v, list) else v for v in values]
    if cls is Died:
        args[1] = DeathCause(args[1])
    return cls(*args)


def _events_to_doc(events: tuple[MembershipEvent, ...]) -> list[list[Any]]:
    return [event_to_doc(e) for e in events[:DOC_EVENTS_LIMIT]]


def _epoch_to_doc(e: Epoch) -> dict[str, Any]:
    # Written out by hand: dataclasses.asdict deep-copies recursively and is ~10x slower on 1000 members.
    return {
        "number": e.number,
        "members": [{"replica_id": x.replica_id, "incarnation": x.incarnation, "role": x.role,
                     "shard_count": x.shard_count, "endpoints": _endpoints_to_doc(x.endpoints), "slot": x.slot}
                    for x in e.members],
        "created_at": e.created_at,
        "reason": e.reason,
        "plane": e.data_plane,
        "events": _events_to_doc(e.events),
        "hosting": e.hosting,
    }


def _history_to_doc(e: Epoch) -> dict[str, Any]:
    """A history entry: who was in the epoch (replica ids only: no roles, incarnations or endpoints)."""
    return {"number": e.number, "members": [x.replica_id for x in e.members], "created_at": e.created_at,
            "reason": e.reason, "events": _events_to_doc(e.events)}


def _epoch_from_doc(d: dict[str, Any]) -> Epoch:
    members = []
    for x in d["members"]:
        if isinstance(x, dict):
            members.append(EpochMember(x["replica_id"], x["incarnation"], x["role"], int(x["shard_count"]),
                                       Endpoints(**x["endpoints"]), int(x.get("slot", NO_SLOT))))
        else:  # a history entry: the replica id only
            members.append(EpochMember(str(x), "", "", 0, Endpoints()))
    return Epoch(number=int(d["number"]), members=tuple(members), created_at=float(d["created_at"]),
                 reason=str(d["reason"]), plane=int(d.get("plane", 0)),
                 events=tuple(event_from_doc(e) for e in d.get("events", ())),
                 hosting=_hosting(d.get("hosting", "")))


def _hosting(value: Any) -> str:
    """A stored epoch's ``hosting`` (one of ``lane_hosts.MODES``)."""
    if value not in lane_hosts.MODES:
        raise ValueError(f"unknown rendezvous hosting {str(value)[:40]!r} in a stored epoch")
    return str(value)


def durable_change(before: State, after: State) -> bool:
    """Whether ``after`` changes what the document holds, so the store must be written: a new epoch; the counter
    alone (a member that came back to a lighthouse that lost it names the epochs it saw: the store's fence is the
    stored number); the end of the job; an incarnation that became over for good (a hung one back after a
    restart must be refused); the job's slot count and replica layout, once named."""
    return (after.epoch is not before.epoch or after.last_number != before.last_number
            or after.finished_step != before.finished_step or after.departed is not before.departed
            or after.slots != before.slots or after.layout != before.layout)


def state_to_doc(state: State) -> dict[str, Any]:
    """The durable part of the state: the epoch counter, the current epoch and recent history.

    Registrations outside the epoch and heartbeat times are volatile: clients re-register when a lighthouse
    answers NOT_FOUND. History entries keep the replica ids only (restored with empty roles and incarnations),
    for the last ``DOC_HISTORY_LIMIT`` epochs. ``finished_step`` (null: the job has not finished) is durable too,
    and so are the incarnations that are over (``departed``, at most ``model.DEPARTED_LIMIT`` per replica, for the
    ``model.DEPARTED_IDS_LIMIT`` replicas that departed last, in departure order): a replica declared dead while it
    hung, back after a restart, must be refused, not registered again.
    """
    return {
        "last_number": state.last_number,
        "epoch": None if state.epoch is None else _epoch_to_doc(state.epoch),
        "history": [_history_to_doc(e) for e in state.history[-DOC_HISTORY_LIMIT:]],
        "finished_step": state.finished_step,
        "departed": [[rid, list(incs)] for rid, incs in state.departed.items()],  # a list: in departure order
        "slots": state.slots,
        "layout": state.layout,
    }


def state_from_doc(doc: dict[str, Any] | None, now: float) -> State:
    """Rebuild the state from a stored document (none stored: the empty state); the epoch's members count as
    registered at ``now`` (its joiners as syncing since ``now``: the join deadline starts again). A document
    without ``finished_step`` or ``departed`` (written before they existed) loads as not finished, with none."""
    if not doc:
        return State()
    epoch = None if doc["epoch"] is None else _epoch_from_doc(doc["epoch"])
    raw = doc.get("departed") or []
    pairs = raw.items() if isinstance(raw, dict) else raw  # a mapping: written before the order was kept
    departed = {str(rid): tuple(str(i) for i in incs) for rid, incs in pairs}
    members = {}
    for x in epoch.members if epoch is not None else ():
        if x.incarnation in departed.get(x.replica_id, ()):
            continue  # dropped while the min-replicas guard held the epoch: over, as before the restart
        members[x.replica_id] = Member(x.replica_id, x.incarnation, x.shard_count, x.endpoints, x.role,
                                       in_epoch=True, registered_at=now,
                                       syncing_since=now if x.role == JOINING else None, slot=x.slot, asks=x.slot)
    return State(
        members=members,
        epoch=epoch,
        last_number=int(doc["last_number"]),
        history=tuple(_epoch_from_doc(e) for e in doc["history"]),
        finished_step=None if doc.get("finished_step") is None else int(doc["finished_step"]),
        departed=departed,
        slots=int(doc.get("slots") or 0),
        layout=str(doc.get("layout") or ""),
    )
