"""Conversions between the wire's protobuf messages (``lighthouse.v1``) and the domain types: roles, endpoints,
epochs. Pure functions; what arrives is validated (``lighthouse.validate``)."""

from __future__ import annotations

import functools

from lighthouse.epoch_view import EpochView
from lighthouse.errors import ValidationError
from lighthouse.model import ACTIVE, JOINING, Endpoints, Epoch, EpochMember
from lighthouse.rendezvous import SCHEME, namespace_of
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.validate import ENDPOINT_MAX, check_text

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


def epoch_to_pb(job_id: str, epoch: Epoch | None, rendezvous: str) -> pb.Epoch:
    """The pushed epoch (number 0 before the first one); ``rendezvous`` is where the lighthouse hosts the data
    plane's rendezvous: ``SCHEME`` (its gRPC Rendezvous service), a TCPStore's ``host:port``, or '' (none)."""
    if epoch is None:
        return pb.Epoch(job_id=job_id, number=0)
    return pb.Epoch(
        job_id=job_id,
        number=epoch.number,
        members=[pb.Member(replica_id=x.replica_id, incarnation=x.incarnation, role=ROLE_TO_PB[x.role],
                           shard_count=x.shard_count, endpoints=endpoints_to_pb(x.endpoints))
                 for x in epoch.members],
        rendezvous=(SCHEME if rendezvous == SCHEME else f"{rendezvous}/" if rendezvous else "")
        + (namespace_of(job_id, epoch.number) if rendezvous else ""),
        created_unix=epoch.created_at,
        reason=epoch.reason,
        plane=epoch.data_plane,
    )


def epoch_from_pb(e: pb.Epoch) -> EpochView:
    """A pushed epoch as a client sees it (an unknown role reads as joining)."""
    return EpochView(
        job_id=e.job_id,
        number=e.number,
        members=tuple(
            EpochMember(x.replica_id, x.incarnation, ROLE_FROM_PB.get(x.role, JOINING), x.shard_count,
                        Endpoints(x.endpoints.data_plane, x.endpoints.catchup, x.endpoints.http))
            for x in e.members
        ),
        rendezvous=e.rendezvous,
        created_unix=e.created_unix,
        reason=e.reason,
        plane=e.plane,
    )


@functools.lru_cache(maxsize=8)
def epoch_from_bytes(raw: bytes) -> EpochView:
    """``epoch_from_pb`` of a serialized Epoch, memoized: every watcher in a process (the emulator runs
    thousands) receives the same bytes for an epoch, and the view is immutable, so it is built once."""
    return epoch_from_pb(pb.Epoch.FromString(raw))
