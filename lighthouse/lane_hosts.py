"""Where a lane's members meet after a membership change (docs/design.md §5, "Lanes at scale"), as pure rules.

The lighthouse sends an epoch and carries no per-rank traffic. Each lane's members rendezvous on a store that one
of them serves (``ftar.lane_store``): the lane's **host**, the first member of the lane's *ranking* that is not
joining. The ranking is a rendezvous (highest-random-weight) hash of the lane and the replica id, so every member
computes it the same way from the epoch alone, the lanes' hosts spread evenly over the replicas, and a death moves
only the lanes its replica hosted: the next epoch leaves the dead out, and the next member of the ranking hosts.
Each member keeps the addresses of its lane's first ``CANDIDATES`` members of the ranking, learned at every
rendezvous, so that after a death it already knows where the new host is. A lane of many members (``SPREAD_FROM``)
meeting on kept addresses spreads its keys over the first ``SPREAD`` members of the ranking (``stores``;
``ftar.spread_store``): each member arrives on, and reads from, one of them, so no one store serves every member.

How an epoch's lanes rendezvous is the lighthouse's choice (``mode``), from the epoch before it:

- ``MEMBERS``: on the hosts' stores, from the addresses the members keep: an epoch that only lost members (at
  most ``LOST_AT_ONCE`` at once) and has no joiner. The lighthouse serves nothing for it.
- ``ANNOUNCED``: on the hosts' stores; each host also sets its address on the lighthouse, one key per lane, for the
  members that do not know it (the first epoch, a joiner, a new incarnation): a set per lane and a get per newcomer
  rank instead of a full rendezvous of every rank.
- ``LIGHTHOUSE``: on the lighthouse's own store, as before member hosting. A re-formed epoch (the data plane broke
  with every member alive: a partition, perhaps between a host and its lane) falls back to it, so a host that some
  members cannot reach never holds the job.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections.abc import Callable, Iterable, Sequence

from lighthouse.model import JOINING, Epoch, EpochMember

LOST_AT_ONCE = 2
"""Members an epoch may lose at once, with no joiner, and still meet on the addresses its members kept."""
SPREAD = 4
"""The stores a lane of ``SPREAD_FROM`` members or more spreads its keys over when it meets on kept addresses."""
SPREAD_FROM = 64
"""The members from which a lane's keys spread, by default (the lighthouse's ``--lane-spread-from``, stamped on every
epoch: ``Epoch.lane_spread_from``): below, one store serves the lane's few calls."""
CANDIDATES = LOST_AT_ONCE + SPREAD
"""The members of a lane's ranking whose addresses every member keeps: whichever ``LOST_AT_ONCE`` of them die, the
first ``SPREAD`` of the next epoch's ranking are among them."""
WEIGHTS_KEPT = 1 << 16
"""(lane, replica) weights a process keeps computed (a rank ranks its own lanes' members: one lane each)."""
RANKINGS_KEPT = 256
"""(members, lane, k) answers of ``candidates`` a process keeps: a rank asks for its lane's several times per
rendezvous, and a process emulating many ranks of one lane (``fthsdp.bench.lanes``) once for all of them."""
MEMBERS = "members"
ANNOUNCED = "announced"
LIGHTHOUSE = ""
"""The modes an epoch's lanes rendezvous in (``Epoch.hosting``); ``LIGHTHOUSE`` is the default of an epoch stored
before member hosting."""
MODES = (MEMBERS, ANNOUNCED, LIGHTHOUSE)


@functools.lru_cache(maxsize=WEIGHTS_KEPT)
def weight(lane: int, replica_id: str) -> int:
    """The rendezvous hash of ``replica_id`` for ``lane`` (64 bits of BLAKE2b: the same on every host and run).
    Kept once computed: every rendezvous of a lane ranks all its members again."""
    return int.from_bytes(hashlib.blake2b(f"{lane}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def _order(lane: int) -> Callable[[str], tuple[int, str]]:
    return lambda rid: (-weight(lane, rid), rid)


def ranking(replica_ids: Iterable[str], lane: int) -> list[str]:
    """``replica_ids`` in the order they host ``lane``: highest weight first (ties, never seen: by id)."""
    return sorted(replica_ids, key=_order(lane))


def host(members: Sequence[EpochMember], lane: int) -> str | None:
    """The member that hosts ``lane``'s rendezvous: the first of the ranking that is not joining (a joiner's address
    is known to nobody yet); ``None`` when every member is joining (no epoch forms so). One pass, no sort."""
    return min((m.replica_id for m in members if m.role != JOINING), key=_order(lane), default=None)


def candidates(replica_ids: Iterable[str], lane: int, k: int = CANDIDATES) -> list[str]:
    """The first ``k`` of ``lane``'s ranking: the members whose addresses the lane's members keep (no full sort;
    kept once computed for the same members, as a tuple of ids)."""
    return list(_first(tuple(replica_ids), lane, k))


@functools.lru_cache(maxsize=RANKINGS_KEPT)
def _first(replica_ids: tuple[str, ...], lane: int, k: int) -> tuple[str, ...]:
    return tuple(heapq.nsmallest(k, replica_ids, key=_order(lane)))


def stores(members: Sequence[EpochMember], lane: int, how: str, spread_from: int = SPREAD_FROM) -> list[str]:
    """The replicas whose stores ``lane`` meets on in an epoch of ``members`` that meets ``how`` (a mode), the host
    first: the host alone; for a lane of at least ``spread_from`` members meeting on kept addresses (``MEMBERS``: no
    joiner), the first ``SPREAD`` of its ranking, every one of them known to every member (``CANDIDATES``)."""
    if how == MEMBERS and len(members) >= spread_from:
        return candidates(tuple(m.replica_id for m in members if m.role != JOINING), lane, SPREAD)
    first = host(members, lane)
    return [] if first is None else [first]


def mode(before: Epoch | None, wanted: Sequence[EpochMember], force: bool) -> str:
    """How the lanes of the epoch formed from ``wanted`` after ``before`` rendezvous (see the module). ``force``: a
    re-formed epoch (same members, the data plane broken): the lighthouse's store."""
    if force:
        return LIGHTHOUSE
    if before is None:
        return ANNOUNCED
    kept = set(before.plane_key())
    if any((m.replica_id, m.incarnation) not in kept or m.role == JOINING for m in wanted):
        return ANNOUNCED
    return MEMBERS if len(kept) - len(wanted) <= LOST_AT_ONCE else ANNOUNCED
