"""The pure rules of member-hosted lane rendezvous (``lighthouse.lane_hosts``, issue 39): who hosts a lane, what the
members keep, and how each epoch's lanes meet, including the host's own death and a host in a partition."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random

from lighthouse import lane_hosts
from lighthouse.lane_hosts import ANNOUNCED, CANDIDATES, LIGHTHOUSE, LOST_AT_ONCE, MEMBERS, SPREAD, SPREAD_FROM
from lighthouse.model import ACTIVE, JOINING, Endpoints, Epoch, EpochMember


def _member(rid: str, role: str = ACTIVE, inc: str = "i0") -> EpochMember:
    return EpochMember(rid, inc, role, 1, Endpoints())


def _epoch(number: int, *members: EpochMember) -> Epoch:
    return Epoch(number=number, members=tuple(members), created_at=0.0, reason="test")


IDS = [f"replica-{i}" for i in range(12)]


def test_every_member_computes_the_same_host_whatever_the_order() -> None:
    members = [_member(r) for r in IDS]
    for lane in range(64):
        assert lane_hosts.host(members, lane) == lane_hosts.host(list(reversed(members)), lane)
        assert lane_hosts.host(members, lane) == lane_hosts.ranking(IDS, lane)[0]


def test_hosts_spread_over_the_replicas() -> None:
    """8,192 lanes of 12 replicas: every replica hosts about 1/12 of them (no hot spot)."""
    members = [_member(r) for r in IDS]
    counts = collections.Counter(lane_hosts.host(members, lane) for lane in range(8192))
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 1.2 * 8192 / 12 and min(counts.values()) > 0.8 * 8192 / 12, counts


def test_the_hosts_death_moves_only_its_lanes_to_the_next_of_the_ranking() -> None:
    members = [_member(r) for r in IDS]
    before = {lane: lane_hosts.host(members, lane) for lane in range(2048)}
    dead = "replica-5"
    after = {lane: lane_hosts.host([x for x in members if x.replica_id != dead], lane) for lane in range(2048)}
    for lane in range(2048):
        if before[lane] == dead:
            # The next of the ranking, which every member kept the address of.
            assert after[lane] == lane_hosts.ranking(IDS, lane)[1]
            assert after[lane] in lane_hosts.candidates(IDS, lane)
        else:
            assert after[lane] == before[lane]


def test_the_host_and_candidates_without_a_sort_are_the_rankings() -> None:
    """``host`` (one pass) and ``candidates`` (top k) answer what the full ranking does, for any membership, joiners
    included: every member of a 1,000-member lane computes them at each rendezvous."""
    import random

    rng = random.Random(39)
    for _ in range(200):
        ids = rng.sample([f"r{i}" for i in range(50)], rng.randint(1, 30))
        members = [_member(r, JOINING if rng.random() < 0.3 else ACTIVE) for r in ids]
        lane = rng.randrange(10_000)
        joining = {m.replica_id for m in members if m.role == JOINING}
        ranked = lane_hosts.ranking(ids, lane)
        assert lane_hosts.host(members, lane) == next((r for r in ranked if r not in joining), None)
        for k in (1, CANDIDATES, 40):
            assert lane_hosts.candidates(ids, lane, k) == ranked[:k]


def test_a_joiner_never_hosts() -> None:
    for lane in range(256):
        top = lane_hosts.ranking(IDS[:3], lane)[0]
        members = [_member(r, JOINING if r == top else ACTIVE) for r in IDS[:3]]
        assert lane_hosts.host(members, lane) == lane_hosts.ranking(IDS[:3], lane)[1]
    assert lane_hosts.host([_member("a", JOINING)], 0) is None


def test_the_kept_candidates_cover_the_host_after_fewer_than_candidates_deaths() -> None:
    """Whatever ``LOST_AT_ONCE`` members die at once, and one member of the ranking joins, every lane's new host
    is among the candidates its members kept from the epoch before."""
    members = [_member(r) for r in IDS]
    for lane in range(512):
        kept = lane_hosts.candidates(IDS, lane)
        dead = set(kept[:LOST_AT_ONCE])
        joining = kept[LOST_AT_ONCE]
        now = [dataclasses.replace(x, role=JOINING) if x.replica_id == joining else x
               for x in members if x.replica_id not in dead]
        assert lane_hosts.host(now, lane) in kept


def test_an_epoch_that_only_lost_members_meets_on_the_members() -> None:
    before = _epoch(5, *(_member(r) for r in IDS[:4]))
    assert lane_hosts.mode(before, before.members[1:], force=False) == MEMBERS
    assert lane_hosts.mode(before, before.members[2:], force=False) == MEMBERS
    # A role change only (the plane is kept): no newcomer.
    assert lane_hosts.mode(before, before.members, force=False) == MEMBERS


def test_too_many_deaths_at_once_announce_the_hosts_on_the_lighthouse() -> None:
    before = _epoch(5, *(_member(r) for r in IDS))
    assert lane_hosts.mode(before, before.members[LOST_AT_ONCE:], force=False) == MEMBERS
    assert lane_hosts.mode(before, before.members[LOST_AT_ONCE + 1:], force=False) == ANNOUNCED


def test_a_large_lane_spreads_over_stores_every_member_kept_whoever_died() -> None:
    """A lane of ``SPREAD_FROM`` members or more meeting on kept addresses meets on the first ``SPREAD`` of its
    ranking, the host first; whichever ``LOST_AT_ONCE`` members die (the stores' own replicas included), every one of
    the next epoch's stores is a candidate the members kept. A smaller lane, or one that meets otherwise, meets on
    its host alone."""
    rng = random.Random(38)
    ids = [f"r{i}" for i in range(SPREAD_FROM + 8)]
    members = [_member(r) for r in ids]
    for lane in range(64):
        kept = lane_hosts.candidates(ids, lane)
        assert len(kept) == CANDIDATES
        on = lane_hosts.stores(members, lane, MEMBERS)
        assert on == kept[:SPREAD] and on[0] == lane_hosts.host(members, lane)
        # Deaths among the kept (the worst case) and anywhere else.
        deaths = [set(c) for c in itertools.combinations(kept, LOST_AT_ONCE)]
        deaths += [set(rng.sample(ids, LOST_AT_ONCE)) for _ in range(8)]
        for dead in deaths:
            now = [m for m in members if m.replica_id not in dead]
            assert len(now) >= SPREAD_FROM
            after = lane_hosts.stores(now, lane, MEMBERS)
            assert len(after) == SPREAD and set(after) <= set(kept) and not set(after) & dead, (lane, dead)
            assert after[0] == lane_hosts.host(now, lane)
        for how in (ANNOUNCED, LIGHTHOUSE):
            assert lane_hosts.stores(members, lane, how) == [lane_hosts.host(members, lane)]
        small = members[:SPREAD_FROM - 1]
        assert lane_hosts.stores(small, lane, MEMBERS) == [lane_hosts.host(small, lane)]
    assert lane_hosts.stores([_member("a", JOINING)], 0, ANNOUNCED) == []


def test_the_first_epoch_a_joiner_or_a_new_incarnation_announce_the_hosts() -> None:
    members = [_member(r) for r in IDS[:3]]
    assert lane_hosts.mode(None, members, force=False) == ANNOUNCED
    before = _epoch(5, *members)
    assert lane_hosts.mode(before, [*members, _member("replica-9", JOINING)], force=False) == ANNOUNCED
    assert lane_hosts.mode(before, [members[0], members[1], _member(IDS[2], inc="i1")], force=False) == ANNOUNCED
    # A joiner still joining when a member dies: it may not know the new host.
    joiner = _epoch(6, *members, _member("replica-9", JOINING))
    assert lane_hosts.mode(joiner, joiner.members[1:], force=False) == ANNOUNCED


def test_a_re_formed_epoch_falls_back_to_the_lighthouse() -> None:
    """A host in a partition: alive, but some of its lane cannot reach it. Their rendezvous fails with every
    member alive, so the lighthouse re-forms the epoch with the same members, and that one meets on the lighthouse's
    own store: the host's partition cannot hold the job."""
    before = _epoch(5, *(_member(r) for r in IDS[:3]))
    assert lane_hosts.mode(before, before.members, force=True) == LIGHTHOUSE


def test_the_lighthouse_stamps_each_epoch_with_its_mode() -> None:
    """Through the membership state machine: the first epoch announces the hosts, a death meets on the members,
    a re-formed epoch (a live suspect: a partition) on the lighthouse, a rejoin announces again."""
    from tests.unit.test_membership import boot, ready, register, report, tick

    state = boot(["a", "b", "c"])
    assert state.epoch is not None and state.epoch.hosting == ANNOUNCED
    dead = tick(state, 10.0, b=5.0).state  # b silent past the heartbeat timeout
    assert dead.epoch is not None and dead.epoch.replica_ids() == ("a", "c") and dead.epoch.hosting == MEMBERS
    pending = report(dead, "a", "c", 20.0, c=0.1)
    reformed = tick(pending.state, 21.0, c=0.1).state  # c heartbeated throughout: re-formed
    assert reformed.epoch is not None and reformed.epoch.number == dead.epoch.number + 1
    assert reformed.epoch.hosting == LIGHTHOUSE
    back = ready(register(reformed, "b", 22.0, n=2).state, "b", JOINING, 22.5, n=2).state
    assert back.epoch is not None and "b" in back.epoch.replica_ids() and back.epoch.hosting == ANNOUNCED
