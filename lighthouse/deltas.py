"""Epoch deltas: what changed between two epochs' member lists, so that an epoch change costs bytes proportional to
the change, not to the membership (a death in a 10,000-replica job is one removed id, not 10,000 members pushed to
10,000 replicas). Pure functions over ``EpochMember`` tuples; the server makes deltas (``lighthouse.server.jobs``),
the client applies them (``lighthouse.proto_codec``).

An epoch lists its members sorted by replica id (``membership._wanted``), so applying a delta sorts the same way and
gives back exactly the epoch's list."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lighthouse.model import EpochMember


@dataclass(frozen=True)
class Delta:
    """From epoch ``base`` to epoch ``number``: the members added or changed, and the ids removed."""

    base: int
    number: int
    upserted: tuple[EpochMember, ...]
    removed: tuple[str, ...]


def diff(base: int, before: Sequence[EpochMember], number: int, after: Sequence[EpochMember]) -> Delta:
    """The delta that turns ``before`` (epoch ``base``) into ``after`` (epoch ``number``)."""
    old = {x.replica_id: x for x in before}
    upserted = tuple(x for x in after if (o := old.get(x.replica_id)) is not x and o != x)
    kept = {x.replica_id for x in after}
    removed = tuple(rid for rid in old if rid not in kept)
    return Delta(base, number, upserted, removed)


def compose(deltas: Iterable[Delta]) -> Delta:
    """One delta for a chain of consecutive ones (each's ``base`` is the previous one's ``number``)."""
    chain = list(deltas)
    if not chain:
        raise ValueError("compose() needs at least one delta")
    upserted: dict[str, EpochMember] = {}
    removed: set[str] = set()
    for prev, d in zip([None, *chain], chain, strict=False):
        if prev is not None and d.base != prev.number:
            raise ValueError(f"deltas not consecutive: {prev.base}->{prev.number}, then {d.base}->{d.number}")
        for rid in d.removed:
            upserted.pop(rid, None)
            removed.add(rid)
        for x in d.upserted:
            upserted[x.replica_id] = x
            removed.discard(x.replica_id)
    # An id removed and then added again is an upsert (it replaces the base's member); one added after the base
    # and removed again is in ``removed`` though the base never had it: applying ignores such ids.
    return Delta(chain[0].base, chain[-1].number, tuple(upserted[k] for k in sorted(upserted)),
                 tuple(sorted(removed)))


def apply(members: Sequence[EpochMember], upserted: Iterable[EpochMember],
          removed: Iterable[str]) -> tuple[EpochMember, ...]:
    """The member list after a delta, sorted by replica id as every epoch's is."""
    out = {x.replica_id: x for x in members}
    for rid in removed:
        out.pop(rid, None)
    for x in upserted:
        out[x.replica_id] = x
    return tuple(out[k] for k in sorted(out))
