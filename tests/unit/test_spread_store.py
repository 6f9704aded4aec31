"""A large lane's rendezvous spread over several members' stores (``ftar.spread_store``, issue 39): the store
semantics as one store (the conformance suite every rendezvous store passes), each arrival on its member's store
alone, and a lane of ``SPREAD_FROM`` members meeting, after a death, on the stores its members kept."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta

import pytest

from ftar.group import _present, meet
from ftar.lane_hosting import LaneHosting
from ftar.lane_store import LaneStoreServer, MemberStore
from ftar.spread_store import ARRIVED, SpreadStore
from lighthouse import lane_hosts
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember
from tests.helpers import store_conformance
from tests.helpers.lane_hub import rendezvous_once

pytestmark = pytest.mark.timeout(90)
JOB = "job-a"
KEY = "catchup-key-of-job-a"
NS = f"{JOB}/epoch3"


def _view(number: int, ids: list[str]) -> EpochView:
    return EpochView(JOB, number, tuple(EpochMember(r, "i1", ACTIVE, 1, Endpoints()) for r in ids),
                     f"members:{JOB}/epoch{number}", 0.0, "test")


@pytest.fixture
def servers() -> Iterator[list[LaneStoreServer]]:
    srvs = [LaneStoreServer(JOB, KEY, "127.0.0.1", lambda: _view(3, ["a"])) for _ in range(3)]
    try:
        yield srvs
    finally:
        for s in srvs:
            s.close()


def _client(srv: LaneStoreServer, wait_s: float) -> MemberStore:
    return MemberStore(srv.address, KEY, JOB, NS, timedelta(seconds=wait_s))


def _spreads(srvs: list[LaneStoreServer]) -> store_conformance.MakeStore:
    """A new member's spread store at each call, each member's own store the next one's."""
    counter = itertools.count()
    return lambda wait_s: SpreadStore([_client(s, wait_s) for s in srvs], next(counter) % len(srvs))


def test_a_spread_store_follows_torchs_store_semantics(servers: list[LaneStoreServer]) -> None:
    store_conformance.check_semantics(_spreads(servers))


def test_blocking_gets_wait_on_a_spread_store(servers: list[LaneStoreServer]) -> None:
    store_conformance.check_blocking_get(_spreads(servers))


def test_a_gloo_group_builds_on_a_spread_store(servers: list[LaneStoreServer]) -> None:
    store_conformance.check_gloo_group(_spreads(servers))


def test_each_arrival_is_on_its_members_store_alone_and_every_other_key_on_all(
        servers: list[LaneStoreServer]) -> None:
    make = _spreads(servers)
    members = [make(1.0) for _ in range(7)]
    for i, m in enumerate(members):
        m.set(f"lane0/{ARRIVED}/{i}", "1")
    members[0].set("lane0/pg/nccl_unique_id", b"u" * 16)
    direct = [_client(s, 0.3) for s in servers]
    for i in range(7):
        on = [d.check([f"lane0/{ARRIVED}/{i}"]) for d in direct]
        assert on == [j == i % 3 for j in range(3)], (i, on)
    assert all(d.get("lane0/pg/nccl_unique_id") == b"u" * 16 for d in direct)
    # Every member finds every arrival (the blame of a failed rendezvous reads them) and reads the id on its own.
    for m in members:
        assert all(m.check([f"lane0/{ARRIVED}/{r}"]) for r in range(7))
        assert not m.check([f"lane0/{ARRIVED}/9"])
        assert m.get("lane0/pg/nccl_unique_id") == b"u" * 16


def test_a_spread_store_needs_its_own_among_them(servers: list[LaneStoreServer]) -> None:
    with pytest.raises(ValueError, match="its own store among 3, not 3"):
        SpreadStore([_client(s, 1.0) for s in servers], 3)
    with pytest.raises(ValueError, match="among 0"):
        SpreadStore([], 0)


def test_a_large_lane_meets_on_the_stores_it_kept_after_a_death() -> None:
    """``SPREAD_FROM`` + 2 members rendezvous once (the candidates announce, every member learns); one of the
    lane's stores dies; every survivor meets on the next epoch's ``SPREAD`` stores from the addresses it kept,
    arrives on its own, and every member sees every arrival and the key one member set."""
    ids = [f"r{i:03d}" for i in range(lane_hosts.SPREAD_FROM + 2)]
    first = _view(3, ids)
    current = [first]
    members = {r: LaneHosting(r, JOB, KEY, "127.0.0.1", lambda: current[0]) for r in ids}
    try:
        rendezvous_once(members.values(), first, JOB, KEY)
        dead = lane_hosts.stores(first.members, 0, lane_hosts.MEMBERS)[1]
        members.pop(dead).close()
        survivors = [r for r in ids if r != dead]
        after = _view(4, survivors)
        current[0] = after
        spread = lane_hosts.stores(after.members, 0, lane_hosts.MEMBERS)
        assert len(spread) == lane_hosts.SPREAD and dead not in spread
        met = {r: meet(after, r, 0, timedelta(seconds=5), lambda: False, None, members[r]) for r in survivors}
        assert {host for _, _, host in met.values()} == {spread[0]}
        world = len(survivors)
        for rank, r in enumerate(survivors):
            base, store, _ = met[r]
            assert isinstance(base, SpreadStore) and base.own == rank % lane_hosts.SPREAD
            assert _present(store, ARRIVED, rank, world) == set(range(world)) - {rank}
        met[survivors[0]][1].set("pg/nccl_unique_id", b"id")
        assert all(store.get("pg/nccl_unique_id") == b"id" for _, store, _ in met.values())
        # Each store holds its share of the arrivals, not every member's.
        for j, rid in enumerate(spread):
            address = members[rid].address()
            direct = MemberStore(address, KEY, JOB, f"{JOB}/epoch4", timedelta(seconds=1))
            arrived = {r for r in range(world) if direct.check([f"lane0/{ARRIVED}/{r}"])}
            assert arrived == {r for r in range(world) if r % lane_hosts.SPREAD == j}
    finally:
        for h in members.values():
            h.close()
