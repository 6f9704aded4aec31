"""A replica group's epochs inside the group (fthsdp.runtime.epoch_relay): rank 0's session relays every epoch to
the other ranks through the group's store, a follower that fell behind takes the newest, rank 0's close ends
its followers, and an epoch crosses the store unchanged."""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from ftar.membership import EpochFeed
from fthsdp.runtime import epoch_relay
from fthsdp.runtime.epoch_relay import GroupEpochs
from lighthouse.client import LighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from lighthouse.proto_codec import epoch_from_bytes, epoch_from_pb, view_to_pb

pytestmark = pytest.mark.timeout(60)
KEY = b"k" * 32
PREFIX = "fthsdp/epochs/r0/inc-r0/"
"""The group's relay key (``startup.group_secret`` draws it in a replica)."""


def _epoch(n: int) -> EpochView:
    members = tuple(EpochMember(f"r{i}", f"inc{i}-{n}", ACTIVE if i else JOINING, 2,
                                Endpoints(catchup=f"127.0.0.1:{9000 + i}")) for i in range(3))
    return EpochView("job", n, members, f"lighthouse://job/epoch{n}", 1_700_000_000.5 + n, f"reason {n}",
                     plane=n - 1)


class _Leader:
    """Rank 0's lighthouse client, without a lighthouse: ``start`` delivers the registration's epoch."""

    replica_id, incarnation = "r0", "inc-r0"

    def __init__(self, feed: EpochFeed) -> None:
        self.feed = feed
        self.started: list[float] = []

    def start(self, deadline_s: float) -> str:
        self.started.append(deadline_s)
        self.feed.publish(_epoch(1))
        return "registration"


@pytest.fixture
def master() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _store(master: dist.TCPStore) -> Any:
    def connect(prefix: str) -> dist.Store:
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        return dist.PrefixStore(prefix, client)
    return connect


def _follower(master: dist.TCPStore) -> tuple[GroupEpochs, LighthouseClient]:
    client = LighthouseClient("127.0.0.1:1", "job", "r0", incarnation="inc-r0")  # never started: no session
    return GroupEpochs(client, EpochFeed(), 1, 2, key=KEY, store=_store(master)), client


def _rank0_closes_and_ends(relay: GroupEpochs, follower: GroupEpochs) -> None:
    relay.close()
    assert follower._thread is not None
    follower._thread.join(timeout=10)
    assert not follower._thread.is_alive(), "rank 0 closed, but its follower still waits"


def test_an_epoch_crosses_unchanged() -> None:
    e = _epoch(7)
    assert epoch_from_pb(view_to_pb(e)) == e


def test_rank_zero_relays_every_epoch_to_a_follower(master: dist.TCPStore) -> None:
    feed = EpochFeed()
    leader = _Leader(feed)
    relay = GroupEpochs(leader, feed, 0, 2, key=KEY, store=_store(master))  # type: ignore[arg-type]
    follower, client = _follower(master)
    seen: list[int] = []
    got = threading.Condition()

    def record(e: EpochView) -> None:
        with got:
            seen.append(e.number)
            got.notify_all()

    original = client.deliver
    client.deliver = lambda e: (original(e), record(e))  # type: ignore[method-assign]
    try:
        assert follower.start(5.0) is None  # a follower registers nothing
        assert relay.start(5.0) == "registration" and leader.started == [5.0]
        first = client.wait_epoch(0, timeout=10)
        assert first == _epoch(1)
        for n in range(2, 6):
            feed.publish(_epoch(n))
            with got:
                assert got.wait_for(lambda n=n: n in seen, timeout=10), f"epoch {n} did not reach the follower"
        assert client.epoch == _epoch(5)
        assert seen == sorted(seen) and seen[-1] == 5
        _rank0_closes_and_ends(relay, follower)
    finally:
        for x in (relay, follower, client):
            x.close()


def test_a_dropped_incarnation_reaches_every_follower(master: dist.TCPStore) -> None:
    """Rank 0 learns from the lighthouse that this incarnation is over (a joiner back as the job ends); its
    followers learn it from the relay, or their exchanges would wait for epochs that never come (seen: rank 1's lane
    reported a peer every second for minutes after rank 0 was dropped)."""
    feed = EpochFeed()
    relay = GroupEpochs(_Leader(feed), feed, 0, 2, key=KEY, store=_store(master))  # type: ignore[arg-type]
    lost: list[str] = []
    follower, client = _follower(master)
    follower.on_lost = lost.append
    try:
        follower.start(5.0)
        relay.start(5.0)
        assert client.wait_epoch(0, timeout=10) == _epoch(1)
        relay.lost("the job finished at step 120")
        assert follower._thread is not None
        follower._thread.join(timeout=10)
        assert not follower._thread.is_alive(), "the follower still waits for epochs"
        assert lost == ["the job finished at step 120"]
        assert client.epoch == _epoch(1)  # the marker is no epoch
    finally:
        for x in (relay, follower, client):
            x.close()


def test_a_follower_behind_takes_the_newest(master: dist.TCPStore) -> None:
    feed = EpochFeed()
    relay = GroupEpochs(_Leader(feed), feed, 0, 2, key=KEY, store=_store(master))  # type: ignore[arg-type]
    relay.start(5.0)
    last = epoch_relay.KEEP + 20
    probe = _store(master)(PREFIX)

    def relayed() -> int:
        """The number of the newest epoch the relay wrote (0: none yet)."""
        if not probe.check(["n"]):
            return 0
        k = epoch_relay.opened(KEY, PREFIX + "n", probe.get("n"))
        assert k is not None
        body = epoch_relay.opened(KEY, PREFIX + k.decode(), probe.get(k.decode()))
        assert body is not None
        return epoch_from_bytes(body).number

    for n in range(2, last + 1):
        feed.publish(_epoch(n))
        # Relayed before the next: the relay takes the newest epoch it was handed, so one published before its
        # thread first ran (epoch 1, on a busy machine) is skipped, and keys do not follow epoch numbers.
        end = time.monotonic() + 10
        while relayed() < n:
            assert time.monotonic() < end, f"epoch {n} was not relayed within 10 s"
            time.sleep(0.005)  # polling a condition with a deadline
    assert int(epoch_relay.opened(KEY, PREFIX + "n", probe.get("n")) or 0) > epoch_relay.KEEP and \
        not probe.check(["1"]), \
        "the relay keeps only the last KEEP epochs"
    follower, client = _follower(master)
    try:
        follower.start(5.0)
        e = client.wait_epoch(last - 1, timeout=10)
        assert e == _epoch(last), f"the follower did not take the newest epoch: {e}"
        _rank0_closes_and_ends(relay, follower)
    finally:
        for x in (relay, follower, client):
            x.close()


def test_a_single_rank_group_relays_nothing() -> None:
    feed = EpochFeed()
    leader = _Leader(feed)

    def no_store(prefix: str) -> dist.Store:
        raise AssertionError("a group of one rank needs no store")

    relay = GroupEpochs(leader, feed, 0, 1, key=KEY, store=no_store)  # type: ignore[arg-type]
    assert relay.start(5.0) == "registration"
    relay.close()


def test_the_group_store_needs_torchruns_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT"):
        epoch_relay.group_store("x/")


def test_a_follower_stops_waiting_when_it_closes(master: dist.TCPStore) -> None:
    """Its thread must leave the store's wait before the process exits (one left inside it aborts the process),
    whether or not rank 0 closed first."""
    follower, client = _follower(master)
    try:
        follower.start(5.0)
        assert follower._thread is not None and follower._thread.is_alive()
        follower.close()
        assert not follower._thread.is_alive(), "the follower's thread still waits on the store"
    finally:
        client.close()


def test_a_forged_epoch_in_the_groups_store_is_refused_and_rank_zeros_is_taken(master: dist.TCPStore) -> None:
    """Issue 41: torchrun's store has no authentication and listens on every interface. One ``set`` of an epoch
    numbered 2^63 naming an attacker's rendezvous used to hold a rank there for good; a forged ``n`` or close marker
    would have stalled or stopped it. Now a follower takes only what rank 0 sealed with the group's key."""
    feed = EpochFeed()
    relay = GroupEpochs(_Leader(feed), feed, 0, 2, key=KEY, store=_store(master))  # type: ignore[arg-type]
    follower, client = _follower(master)
    attacker = _store(master)(PREFIX)
    forged = dataclasses.replace(_epoch(2**63 - 1), rendezvous="attacker.example:1")
    try:
        follower.start(5.0)
        relay.start(5.0)
        assert client.wait_epoch(0, timeout=10) == _epoch(1)
        attacker.set("2", view_to_pb(forged).SerializeToString())  # unsealed
        attacker.set("n", "2")
        attacker.set("3", epoch_relay.seal(b"x" * 32, PREFIX + "3", view_to_pb(forged).SerializeToString()))
        replayed = attacker.get("1")  # rank 0's own epoch 1, moved to another key
        attacker.set("4", replayed)
        feed.publish(_epoch(2))  # rank 0's next epoch replaces the forgery under key 2
        assert client.wait_epoch(1, timeout=10) == _epoch(2)
        assert all(e.number < 2**62 for e in [client.epoch] if e is not None)
        attacker.set("3", b"")  # a forged close: ignored, the follower goes on
        feed.publish(_epoch(3))
        assert client.wait_epoch(2, timeout=10) == _epoch(3)
        _rank0_closes_and_ends(relay, follower)
    finally:
        for x in (relay, follower, client):
            x.close()


def test_a_seal_is_bound_to_its_key_and_its_place() -> None:
    sealed = epoch_relay.seal(KEY, PREFIX + "5", b"body")
    assert epoch_relay.opened(KEY, PREFIX + "5", sealed) == b"body"
    assert epoch_relay.opened(KEY, PREFIX + "6", sealed) is None  # replayed under another key
    assert epoch_relay.opened(b"x" * 32, PREFIX + "5", sealed) is None  # another group's key
    assert epoch_relay.opened(KEY, PREFIX + "5", sealed[:-1] + b"x") is None  # changed
    assert epoch_relay.opened(KEY, PREFIX + "5", b"short") is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        GroupEpochs(_Leader(EpochFeed()), EpochFeed(), 0, 1, key=b"")  # type: ignore[arg-type]
