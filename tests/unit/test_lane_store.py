"""A member's lane store (``ftar.lane_store``, issue 39): the rendezvous store's semantics (the conformance suite the
lighthouse's store passes too), every request authenticated by a MAC under the job's catch-up key, bad input
refused without changing anything; and ``ftar.lane_hosting``: where a lane meets, what its members learn."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest

from ftar import store_mac
from ftar.lane_hosting import LaneHosting
from ftar.lane_store import SERVICE, InsecureLaneStore, LaneStoreServer, MemberStore
from ftar.store import StoreRefused
from lighthouse import lane_hosts
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from lighthouse.v1 import lighthouse_pb2 as pb
from tests.helpers import store_conformance
from tests.helpers.lane_hub import rendezvous_once

pytestmark = pytest.mark.timeout(60)
JOB = "job-a"
KEY = "catchup-key-of-job-a"


def _view(number: int, *members: tuple[str, str], rendezvous: str = "") -> EpochView:
    return EpochView(JOB, number, tuple(EpochMember(rid, "i1", role, 1, Endpoints()) for rid, role in members),
                     rendezvous or f"members:{JOB}/epoch{number}", 0.0, "test")


@pytest.fixture
def server() -> Iterator[LaneStoreServer]:
    srv = LaneStoreServer(JOB, KEY, "127.0.0.1", lambda: _view(3, ("a", ACTIVE)))
    try:
        yield srv
    finally:
        srv.close()


def _store(srv: LaneStoreServer, wait_s: float = 2.0, key: str = KEY, ns: str = f"{JOB}/epoch3") -> MemberStore:
    return MemberStore(srv.address, key, JOB, ns, timedelta(seconds=wait_s))


def test_the_lane_store_follows_torchs_store_semantics(server: LaneStoreServer) -> None:
    store_conformance.check_semantics(lambda wait_s: _store(server, wait_s))


def test_blocking_gets_wait_on_the_lane_store(server: LaneStoreServer) -> None:
    store_conformance.check_blocking_get(lambda wait_s: _store(server, wait_s))


def test_a_gloo_group_builds_on_the_lane_store(server: LaneStoreServer) -> None:
    store_conformance.check_gloo_group(lambda wait_s: _store(server, wait_s))


def _raw(srv: LaneStoreServer, method: str, req: pb.RendezvousRequest,
         metadata: tuple[tuple[str, str], ...]) -> pb.RendezvousResponse:
    with grpc.insecure_channel(srv.address) as ch:
        call = ch.unary_unary(f"/{SERVICE}/{method}", request_serializer=None,
                              response_deserializer=pb.RendezvousResponse.FromString)
        resp: pb.RendezvousResponse = call(req.SerializeToString(), metadata=metadata, timeout=10)
        return resp


def test_requests_without_a_valid_mac_are_refused_and_change_nothing(server: LaneStoreServer) -> None:
    good = _store(server)
    good.set("k", b"v")
    req = pb.RendezvousRequest(job_id=JOB, namespace=f"{JOB}/epoch3", keys=["k"], value=b"forged")
    body = req.SerializeToString()
    path = f"/{SERVICE}/Set"
    signed = store_mac.sign(KEY, path, body, time.time())
    cases = {
        "no MAC": (),
        "another key": store_mac.sign("another-jobs-key", path, body, time.time()),
        "another method": store_mac.sign(KEY, f"/{SERVICE}/Add", body, time.time()),
        "stale": store_mac.sign(KEY, path, body, time.time() - 3 * store_mac.SKEW_S),
    }
    for why, metadata in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            _raw(server, "Set", req, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
    # An altered request under a genuine MAC, and a genuine one replayed.
    altered = pb.RendezvousRequest(job_id=JOB, namespace=f"{JOB}/epoch3", keys=["k"], value=b"other")
    with pytest.raises(grpc.RpcError) as e:
        _raw(server, "Set", altered, signed)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _raw(server, "Set", req, signed)  # the genuine request once: admitted
    assert good.get("k") == b"forged"
    good.set("k", b"v")
    with pytest.raises(grpc.RpcError) as e:
        _raw(server, "Set", req, signed)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in (e.value.details() or "")
    assert good.get("k") == b"v"


def test_bad_input_is_refused_with_a_clear_error(server: LaneStoreServer) -> None:
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT.*serves job"):
        MemberStore(server.address, KEY, "job-b", "job-b/epoch3", timedelta(seconds=1)).set("k", b"v")
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT.*not a current or recent epoch"):
        _store(server, ns=f"{JOB}/epoch999").set("k", b"v")
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT.*exceeds"):
        _store(server).set("big", b"x" * (64 * 1024))
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT.*is not '<job>/epoch<N>'"):
        _store(server, ns="garbage").set("k", b"v")
    assert not _store(server).check(["big"])
    body = b"\xff\xff not a request"  # signed, so it is the body, not the MAC, that is refused
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary(f"/{SERVICE}/Set", request_serializer=None,
                              response_deserializer=pb.RendezvousResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(body, metadata=store_mac.sign(KEY, f"/{SERVICE}/Set", body, time.time()), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A member a few epochs ahead of this one (it heard of the epoch first) is admitted.
    _store(server, ns=f"{JOB}/epoch5").set("k", b"v")


def test_without_a_key_it_serves_loopback_only() -> None:
    with pytest.raises(InsecureLaneStore, match="loopback"):
        LaneStoreServer(JOB, "", "0.0.0.0", lambda: None)
    srv = LaneStoreServer(JOB, "", "127.0.0.1", lambda: None)
    try:
        s = MemberStore(srv.address, "", JOB, f"{JOB}/epoch1", timedelta(seconds=1))
        s.set("k", b"v")
        assert s.get("k") == b"v"
    finally:
        srv.close()


def test_the_verifier_bounds_what_it_remembers() -> None:
    v = store_mac.Verifier(KEY, capacity=2)
    for i in range(2):
        md = dict(store_mac.sign(KEY, "m", b"x", 100.0 + i))
        assert v.refusal("m", b"x", md, 100.0 + i) is None
    md = dict(store_mac.sign(KEY, "m", b"x", 101.0))
    assert "too many" in (v.refusal("m", b"x", md, 101.0) or "")
    # Past the window the old nonces are forgotten (they would be refused as stale anyway).
    assert v.refusal("m", b"x", dict(store_mac.sign(KEY, "m", b"x", 300.0)), 300.0) is None


# --- lane hosting ---------------------------------------------------------------------------------------------


def _hosting(rid: str, epoch: list[EpochView]) -> LaneHosting:
    return LaneHosting(rid, JOB, KEY, "127.0.0.1", lambda: epoch[0])


def test_the_members_meet_on_the_host_they_learned_at_the_rendezvous_before() -> None:
    """Three members rendezvous once (announce, learn); after the host of lane 0 dies, the survivors find the next
    host from what they kept, with nobody else to ask."""
    ids = ["a", "b", "c"]
    first = _view(3, *((r, ACTIVE) for r in ids))
    current = [first]
    members = {r: _hosting(r, current) for r in ids}
    try:
        rendezvous_once(members.values(), first, JOB, KEY)
        host = lane_hosts.host(first.members, 0)
        assert host is not None
        survivors = [r for r in ids if r != host]
        after = _view(4, *((r, ACTIVE) for r in survivors))
        current[0] = after
        new_host = lane_hosts.host(after.members, 0)
        stores = {r: members[r].open(after, 0, None, timedelta(seconds=2), lambda: False) for r in survivors}
        assert {h for _, h in stores.values()} == {new_host}
        stores[survivors[0]][0].set("hello", b"1")
        assert stores[survivors[1]][0].get("hello") == b"1"  # the same store: the new host's
    finally:
        for h in members.values():
            h.close()


def test_a_member_that_does_not_know_the_host_says_so() -> None:
    epoch = _view(4, ("a", ACTIVE), ("b", ACTIVE))
    host = lane_hosts.host(epoch.members, 0)
    other = "b" if host == "a" else "a"
    h = _hosting(other, [epoch])
    try:
        with pytest.raises(StoreRefused, match=f"no address known for {host}, the host of lane 0"):
            h.open(epoch, 0, None, timedelta(seconds=1), lambda: False)
    finally:
        h.close()


def test_a_joiner_is_never_the_host_it_has_to_find() -> None:
    for lane in range(32):
        epoch = _view(4, ("a", ACTIVE), ("j", JOINING))
        assert lane_hosts.host(epoch.members, lane) == "a"
