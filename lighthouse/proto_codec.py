"""Conversions between the wire's protobuf messages (``lighthouse.v1``) and the domain types: roles, endpoints,
epochs. Pure functions; what arrives is validated (``lighthouse.validate``)."""

from __future__ import annotations

import functools
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from lighthouse import deltas
from lighthouse.epoch_view import EpochView
from lighthouse.errors import ValidationError
from lighthouse.model import ACTIVE, JOINING, NO_SLOT, Endpoints, Epoch, EpochMember
from lighthouse.rendezvous import HOSTING_SCHEMES, MEMBERS_SCHEME, SCHEME, namespace_of
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.validate import ENDPOINT_MAX, check_text

MAX_EPOCH_BYTES = 64 * 1024 * 1024
"""The most a compressed epoch may inflate to (``SessionUpdate.epoch_zlib``): over a million members."""
ROLE_TO_PB = {ACTIVE: pb.ROLE_ACTIVE, JOINING: pb.ROLE_JOINING}
ROLE_FROM_PB: dict[int, str] = {v: k for k, v in ROLE_TO_PB.items()}


def role_from_pb(role: int) -> str:
    """A role from a request (refuses anything but JOINING and ACTIVE)."""
    if role not in ROLE_FROM_PB:
        raise ValidationError(f"role {role} is not JOINING or ACTIVE")
    return ROLE_FROM_PB[role]


def endpoints_from_pb(e: pb.Endpoints) -> Endpoints:
    """Endpoints from a request, each at most ``ENDPOINT_MAX`` characters."""
    for name in ("data_plane", "catchup", "http"):
        check_text(f"endpoints.{name}", getattr(e, name), ENDPOINT_MAX)
    return Endpoints(data_plane=e.data_plane, catchup=e.catchup, http=e.http)


def endpoints_to_pb(e: Endpoints) -> pb.Endpoints:
    return pb.Endpoints(data_plane=e.data_plane, catchup=e.catchup, http=e.http)


def member_to_pb(x: EpochMember) -> pb.Member:
    return pb.Member(replica_id=x.replica_id, incarnation=x.incarnation, role=ROLE_TO_PB[x.role],
                     shard_count=x.shard_count, endpoints=endpoints_to_pb(x.endpoints),
                     slot=None if x.slot == NO_SLOT else x.slot)


def member_from_pb(x: pb.Member) -> EpochMember:
    """A pushed member (an unknown role reads as joining)."""
    return EpochMember(x.replica_id, x.incarnation, ROLE_FROM_PB.get(x.role, JOINING), x.shard_count,
                       Endpoints(x.endpoints.data_plane, x.endpoints.catchup, x.endpoints.http),
                       x.slot if x.HasField("slot") else NO_SLOT)


def _rendezvous_of(job_id: str, epoch: Epoch, rendezvous: str) -> str:
    """Where ``epoch``'s lanes rendezvous (see ``epoch_to_pb``)."""
    if not rendezvous:
        return ""
    ns = namespace_of(job_id, epoch.number)
    if rendezvous == MEMBERS_SCHEME:
        return HOSTING_SCHEMES[epoch.hosting] + ns
    return SCHEME + ns if rendezvous == SCHEME else f"{rendezvous}/{ns}"


def epoch_to_pb(job_id: str, epoch: Epoch | None, rendezvous: str, spread_from: int = 0) -> pb.Epoch:
    """The pushed epoch (number 0 before the first one); ``rendezvous`` is where the lighthouse hosts the data
    plane's rendezvous: ``SCHEME`` (its gRPC Rendezvous service), ``MEMBERS_SCHEME`` (the lanes' members host it,
    as the epoch's ``hosting`` says, with the lighthouse's service behind them), a TCPStore's ``host:port``, or ''
    (none); ``spread_from``: the lighthouse's ``lane_spread_from`` (0: not said)."""
    if epoch is None:
        return pb.Epoch(job_id=job_id, number=0)
    return pb.Epoch(
        job_id=job_id,
        number=epoch.number,
        members=[member_to_pb(x) for x in epoch.members],
        rendezvous=_rendezvous_of(job_id, epoch, rendezvous),
        created_unix=epoch.created_at,
        reason=epoch.reason,
        plane=epoch.data_plane,
        lane_spread_from=spread_from,
    )


def epoch_from_pb(e: pb.Epoch) -> EpochView:
    """A pushed epoch as a client sees it (an unknown role reads as joining)."""
    return EpochView(
        job_id=e.job_id,
        number=e.number,
        members=tuple(member_from_pb(x) for x in e.members),
        rendezvous=e.rendezvous,
        created_unix=e.created_unix,
        reason=e.reason,
        plane=e.plane,
        lane_spread_from=e.lane_spread_from,
    )


def view_to_pb(v: EpochView) -> pb.Epoch:
    """An epoch as a client holds it, back on the wire (``epoch_from_pb`` inverted): how a replica group's rank 0
    hands it to the group's other ranks."""
    return pb.Epoch(job_id=v.job_id, number=v.number, members=[member_to_pb(x) for x in v.members],
                    rendezvous=v.rendezvous, created_unix=v.created_unix, reason=v.reason, plane=v.plane,
                    lane_spread_from=v.lane_spread_from)


@functools.lru_cache(maxsize=8)
def epoch_from_bytes(raw: bytes) -> EpochView:
    """``epoch_from_pb`` of a serialized Epoch, memoized: every watcher in a process (the emulator runs
    thousands) receives the same bytes for an epoch, and the view is immutable, so it is built once."""
    return epoch_from_pb(pb.Epoch.FromString(raw))


def delta_to_pb(job_id: str, epoch: Epoch, rendezvous: str, d: deltas.Delta, spread_from: int = 0) -> pb.EpochDelta:
    """The delta ``d`` that leads to ``epoch``, with the rest of ``epoch``'s fields (as ``epoch_to_pb`` has them)."""
    return pb.EpochDelta(job_id=job_id, number=d.number, base=d.base,
                         upserted=[member_to_pb(x) for x in d.upserted], removed=list(d.removed),
                         rendezvous=_rendezvous_of(job_id, epoch, rendezvous), created_unix=epoch.created_at,
                         reason=epoch.reason, plane=epoch.data_plane, lane_spread_from=spread_from)


@dataclass(frozen=True)
class DeltaView:
    """A pushed delta as a client holds it until it applies it to its epoch (``apply_delta``)."""

    job_id: str
    number: int
    base: int
    upserted: tuple[EpochMember, ...]
    removed: tuple[str, ...]
    rendezvous: str
    created_unix: float
    reason: str
    plane: int
    lane_spread_from: int = 0


@functools.lru_cache(maxsize=8)
def update_from_bytes(raw: bytes) -> EpochView | DeltaView:
    """A serialized ``SessionUpdate``: the full epoch's view (compressed or not), or the delta's. Memoized like
    ``epoch_from_bytes``. Raises ``DecodeError`` (or ``zlib.error``) on bad bytes."""
    u = pb.SessionUpdate.FromString(raw)
    kind = u.WhichOneof("update")
    if kind == "epoch_zlib":
        inflate = zlib.decompressobj()
        data = inflate.decompress(u.epoch_zlib, MAX_EPOCH_BYTES)
        if inflate.unconsumed_tail:
            raise DecodeError(f"compressed epoch larger than {MAX_EPOCH_BYTES} bytes")
        return epoch_from_pb(pb.Epoch.FromString(data))
    if kind == "delta":
        d = u.delta
        return DeltaView(d.job_id, d.number, d.base, tuple(member_from_pb(x) for x in d.upserted),
                         tuple(d.removed), d.rendezvous, d.created_unix, d.reason, d.plane, d.lane_spread_from)
    return epoch_from_pb(u.epoch)


_APPLIED: OrderedDict[tuple[int, int], tuple[EpochView, DeltaView, EpochView]] = OrderedDict()
_APPLIED_LIMIT = 16
_APPLIED_LOCK = threading.Lock()  # clients on several threads of one process (tests) share the cache


def apply_delta(base: EpochView, d: DeltaView) -> EpochView:
    """The epoch ``d`` leads to from ``base`` (which must be epoch ``d.base``: else ``ValueError``). Memoized by the
    two objects' identities (the cache holds them, so the identities stay theirs): a process that runs many
    sessions (the emulator) builds each new epoch once, as a real replica, in its own process, does."""
    if base.number != d.base:
        raise ValueError(f"delta {d.base}->{d.number} does not apply to epoch {base.number}")
    key = (id(base), id(d))
    with _APPLIED_LOCK:
        hit = _APPLIED.get(key)
        if hit is not None:
            _APPLIED.move_to_end(key)
            return hit[2]
    view = EpochView(job_id=d.job_id, number=d.number, members=deltas.apply(base.members, d.upserted, d.removed),
                     rendezvous=d.rendezvous, created_unix=d.created_unix, reason=d.reason, plane=d.plane,
                     lane_spread_from=d.lane_spread_from)
    with _APPLIED_LOCK:
        _APPLIED[key] = (base, d, view)
        if len(_APPLIED) > _APPLIED_LIMIT:
            _APPLIED.popitem(last=False)
    return view
