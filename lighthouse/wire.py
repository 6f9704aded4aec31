"""Conversions between the wire (protobuf), the decision's dataclasses and the store's JSON documents,
and validation of what arrives on the wire. Pure functions."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse import membership as m

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""Matched with ``fullmatch`` (a ``$`` anchor would let a trailing newline through)."""
ENDPOINT_MAX = 256
REASON_MAX = 1024
SHARD_MAX = 1 << 20
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest request the server accepts; larger ones get RESOURCE_EXHAUSTED before any handler runs."""

ROLE_TO_PB = {m.ACTIVE: pb.ROLE_ACTIVE, m.JOINING: pb.ROLE_JOINING}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}


class ValidationError(ValueError):
    """A field of a request is malformed; the message names the field."""


def check_id(field: str, value: str) -> str:
    if not value:
        raise ValidationError(f"{field} is empty")
    if not ID_RE.fullmatch(value):
        raise ValidationError(f"{field} {value[:40]!r}{'…' if len(value) > 40 else ''} is not 1-128 characters of "
                              "letters, digits, '.', '_', ':' or '-' (starting with a letter or digit)")
    return value


def check_text(field: str, value: str, limit: int = REASON_MAX) -> str:
    if len(value) > limit:
        raise ValidationError(f"{field} is longer than {limit} characters")
    return value


def endpoints_from_pb(e: pb.Endpoints) -> m.Endpoints:
    for name in ("data_plane", "catchup", "http"):
        check_text(f"endpoints.{name}", getattr(e, name), ENDPOINT_MAX)
    return m.Endpoints(data_plane=e.data_plane, catchup=e.catchup, http=e.http)


def role_from_pb(role: int) -> str:
    if role not in ROLE_FROM_PB:
        raise ValidationError(f"role {role} is not JOINING or ACTIVE")
    return ROLE_FROM_PB[role]


def epoch_to_pb(job_id: str, epoch: m.Epoch | None, rendezvous: str) -> pb.Epoch:
    if epoch is None:
        return pb.Epoch(job_id=job_id, number=0)
    return pb.Epoch(
        job_id=job_id,
        number=epoch.number,
        members=[
            pb.Member(replica_id=x.replica_id, incarnation=x.incarnation, role=ROLE_TO_PB[x.role],
                      shard_count=x.shard_count,
                      endpoints=pb.Endpoints(data_plane=x.endpoints.data_plane, catchup=x.endpoints.catchup,
                                             http=x.endpoints.http))
            for x in epoch.members
        ],
        rendezvous=f"{rendezvous}/{job_id}/epoch{epoch.number}" if rendezvous else "",
        created_unix=epoch.created_at,
        reason=epoch.reason,
        plane=epoch.data_plane,
    )


# --- what clients see -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochView:
    """An epoch as a client sees it."""

    job_id: str
    number: int
    members: tuple[m.EpochMember, ...]
    rendezvous: str
    created_unix: float
    reason: str
    plane: int = 0
    """The epoch whose data-plane groups this one keeps (see ``Epoch.plane`` in the proto)."""

    @property
    def data_plane(self) -> int:
        return self.plane or self.number

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(x.replica_id for x in self.members)

    @functools.cached_property
    def _by_id(self) -> dict[str, m.EpochMember]:
        return {x.replica_id: x for x in self.members}

    def member(self, replica_id: str) -> m.EpochMember | None:
        return self._by_id.get(replica_id)

    @property
    def contributors(self) -> int:
        return sum(1 for x in self.members if x.role == m.ACTIVE)


@functools.lru_cache(maxsize=8)
def epoch_from_bytes(raw: bytes) -> EpochView:
    """``epoch_from_pb`` of a serialized Epoch, memoized: every watcher in a process (the emulator runs
    thousands) receives the same bytes for an epoch, and the view is immutable, so it is built once."""
    return epoch_from_pb(pb.Epoch.FromString(raw))


def epoch_from_pb(e: pb.Epoch) -> EpochView:
    return EpochView(
        job_id=e.job_id,
        number=e.number,
        members=tuple(
            m.EpochMember(x.replica_id, x.incarnation, ROLE_FROM_PB.get(x.role, m.JOINING), x.shard_count,
                          m.Endpoints(x.endpoints.data_plane, x.endpoints.catchup, x.endpoints.http))
            for x in e.members
        ),
        rendezvous=e.rendezvous,
        created_unix=e.created_unix,
        reason=e.reason,
        plane=e.plane,
    )


# --- the store's document -------------------------------------------------------------------------------------


DOC_HISTORY_LIMIT = 16
"""Epochs of history kept in the stored document (the live state keeps ``membership.HISTORY_LIMIT``). The
document is written on every epoch change, on the lighthouse's event loop, so it must stay small."""


def _endpoints_to_doc(e: m.Endpoints) -> dict[str, str]:
    return {"data_plane": e.data_plane, "catchup": e.catchup, "http": e.http}


def _epoch_to_doc(e: m.Epoch) -> dict[str, Any]:
    # Written out by hand: dataclasses.asdict deep-copies recursively and is ~10x slower on 1000 members.
    return {
        "number": e.number,
        "members": [{"replica_id": x.replica_id, "incarnation": x.incarnation, "role": x.role,
                     "shard_count": x.shard_count, "endpoints": _endpoints_to_doc(x.endpoints)}
                    for x in e.members],
        "created_at": e.created_at,
        "reason": e.reason,
        "plane": e.data_plane,
    }


def _history_to_doc(e: m.Epoch) -> dict[str, Any]:
    """A history entry: who was in the epoch (replica ids only: no roles, incarnations or endpoints)."""
    return {"number": e.number, "members": [x.replica_id for x in e.members], "created_at": e.created_at,
            "reason": e.reason}


def _epoch_from_doc(d: dict[str, Any]) -> m.Epoch:
    members = []
    for x in d["members"]:
        if isinstance(x, dict):
            members.append(m.EpochMember(x["replica_id"], x["incarnation"], x["role"], int(x["shard_count"]),
                                         m.Endpoints(**x["endpoints"])))
        else:  # a history entry: the replica id only
            members.append(m.EpochMember(str(x), "", "", 0, m.Endpoints()))
    return m.Epoch(number=int(d["number"]), members=tuple(members), created_at=float(d["created_at"]),
                   reason=str(d["reason"]), plane=int(d.get("plane", 0)))


def state_to_doc(state: m.State) -> dict[str, Any]:
    """The durable part of the state: the epoch counter, the current epoch and recent history.

    Registrations outside the epoch and heartbeat times are volatile: clients re-register when a lighthouse
    answers NOT_FOUND. History entries keep the replica ids only (restored with empty roles and incarnations),
    for the last ``DOC_HISTORY_LIMIT`` epochs.
    """
    return {
        "last_number": state.last_number,
        "epoch": None if state.epoch is None else _epoch_to_doc(state.epoch),
        "history": [_history_to_doc(e) for e in state.history[-DOC_HISTORY_LIMIT:]],
    }


def state_from_doc(doc: dict[str, Any], now: float) -> m.State:
    """Rebuild the state from a stored document; the epoch's members count as registered at ``now``."""
    epoch = None if doc["epoch"] is None else _epoch_from_doc(doc["epoch"])
    members = {}
    for x in epoch.members if epoch is not None else ():
        members[x.replica_id] = m.Member(x.replica_id, x.incarnation, x.shard_count, x.endpoints, x.role,
                                         in_epoch=True, registered_at=now)
    return m.State(
        members=members,
        epoch=epoch,
        last_number=int(doc["last_number"]),
        history=tuple(_epoch_from_doc(e) for e in doc["history"]),
    )
