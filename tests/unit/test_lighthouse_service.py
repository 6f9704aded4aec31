"""The lighthouse over real gRPC and HTTP on loopback, in process: the happy path, refusals of bad input (which
change no state and leave the server serving), the status side port, reflection and push latency with real
clients. (The command line is in tests/integration/test_lighthouse_server.py.)"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lighthouse import membership as m
from lighthouse import validate
from lighthouse.client import LighthouseClient
from lighthouse.stores.memory import InMemoryStore
from lighthouse.stragglers import MAX_LANES, pack_lanes
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, ServerThread, heartbeat, register, status, wait_until

# Liveness out of the way (tests drive heartbeats by hand); bootstrap waits for two replicas.
PAIR = m.Policy(min_replicas=1, expected_replicas=2, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0,
                confirm_age_s=1.0)


def snapshot(stub: pb_grpc.LighthouseStub, job: str = JOB) -> tuple[Any, ...]:
    """What must not change when a request is refused."""
    st = status(stub, job)
    return (st.epoch.number, tuple((x.replica_id, x.incarnation, x.role, x.in_epoch) for x in st.members),
            tuple(h.epoch for h in st.history))


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[attr-defined,no-any-return]


def details_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def http_get(addr: str, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


class Watcher:
    """A Watch stream read on a background thread, so a test can wait on what arrived with a deadline."""

    def __init__(self, stub: pb_grpc.LighthouseStub, after: int = 0, job: str = JOB,
                 replica: tuple[str, str] = ("", "")) -> None:
        self.epochs: list[pb.Epoch] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self.call = stub.Watch(pb.WatchRequest(job_id=job, after_epoch=after, replica_id=replica[0],
                                               incarnation=replica[1]), timeout=60)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for e in self.call:
                with self._cond:
                    self.epochs.append(e)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, number: int, timeout: float = 5.0) -> pb.Epoch:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(e.number >= number for e in self.epochs) or self.ended.is_set(),
                                     timeout)
            found = [e for e in self.epochs if e.number >= number]
        assert ok and found, f"epoch {number} not pushed within {timeout}s (got {[e.number for e in self.epochs]})"
        return found[0]

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=5)


@pytest.fixture
def watchers() -> Iterator[Callable[..., Watcher]]:
    made: list[Watcher] = []

    def watch(stub: pb_grpc.LighthouseStub, after: int = 0, job: str = JOB, replica: tuple[str, str] = ("", "")
              ) -> Watcher:
        w = Watcher(stub, after, job, replica)
        made.append(w)
        return w

    yield watch
    for w in made:
        w.close()


@pytest.fixture
def pair(start_server: Callable[..., ServerThread],
         channel_to: Callable[[ServerThread], grpc.Channel]) -> tuple[ServerThread, pb_grpc.LighthouseStub,
                                                                   dict[str, str]]:
    """A server whose first epoch holds replicas a and b (active); returns their incarnations."""
    s = start_server(PAIR)
    stub = pb_grpc.LighthouseStub(channel_to(s))
    incs = {rid: register(stub, rid).incarnation for rid in ("a", "b")}
    assert status(stub).epoch.number == 1
    return s, stub, incs


# --- the happy path ---------------------------------------------------------------------------------------------


def test_register_heartbeat_watch_ready_report_leave_status(
        slow_server: ServerThread, slow_stub: pb_grpc.LighthouseStub, watchers: Callable[..., Watcher]) -> None:
    stub = slow_stub
    a = register(stub, "a", data_plane="127.0.0.1:7001", catchup="127.0.0.1:7002")
    assert a.role == pb.ROLE_ACTIVE and a.incarnation and not a.resume  # a fresh start: nothing to resume
    assert a.heartbeat_interval_s == 1.0 and a.heartbeat_timeout_s == 30.0
    w = watchers(stub)
    e1 = w.wait_for(1)
    assert e1.number == 1 and [x.replica_id for x in e1.members] == ["a"]
    assert e1.members[0].endpoints.data_plane == "127.0.0.1:7001" and e1.job_id == JOB
    assert e1.rendezvous == ""  # rendezvous off in this server

    b = register(stub, "b")
    assert b.role == pb.ROLE_JOINING and b.epoch.number == 1 and not b.resume  # catches up from a instead
    assert heartbeat(stub, "b", b.incarnation, step=7).epoch == 1
    assert stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation=b.incarnation,
                                      role=pb.ROLE_JOINING), timeout=5).epoch == 2
    e2 = w.wait_for(2)
    assert {x.replica_id: x.role for x in e2.members} == {"a": pb.ROLE_ACTIVE, "b": pb.ROLE_JOINING}
    assert stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation=b.incarnation,
                                      role=pb.ROLE_ACTIVE), timeout=5).epoch == 3
    e3 = w.wait_for(3)
    assert {x.replica_id: x.role for x in e3.members} == {"a": pb.ROLE_ACTIVE, "b": pb.ROLE_ACTIVE}

    # A report about a heartbeating peer is recorded, not confirmed (confirm age is 10 s here).
    heartbeat(stub, "b", b.incarnation, step=8)
    r = stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="a", reporter_incarnation=a.incarnation,
                                            suspect_replica_id="b", epoch=3, reason="allreduce timed out"),
                           timeout=5)
    assert not r.confirmed and r.epoch == 3 and r.detail

    st = status(stub)
    assert st.epoch.number == 3 and st.leader
    assert [(x.replica_id, x.role, x.in_epoch, x.step) for x in st.members] == [
        ("a", pb.ROLE_ACTIVE, True, 0), ("b", pb.ROLE_ACTIVE, True, 8)]
    assert all(0 <= x.last_heartbeat_age_s < 30 for x in st.members)
    assert [h.epoch for h in st.history] == [1, 2, 3]
    assert list(st.history[1].members) == ["a", "b"] and "ready to join" in st.history[1].reason

    assert stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="b", incarnation=b.incarnation,
                                      reason="done"), timeout=5).epoch == 4
    e4 = w.wait_for(4)
    assert [x.replica_id for x in e4.members] == ["a"] and "left: done" in e4.reason
    assert [x.replica_id for x in status(stub).members] == ["a"]
    # Every pushed epoch came in order, none twice.
    numbers = [e.number for e in w.epochs]
    assert numbers == sorted(set(numbers)) and numbers[-1] == 4


def test_watch_after_current_epoch_waits_for_the_next(pair: Any, watchers: Callable[..., Watcher]) -> None:
    s, stub, incs = pair
    w = watchers(stub, after=1)
    register(stub, "c")  # joining: no new epoch yet
    c = status(stub).members[2]
    assert c.replica_id == "c" and not c.in_epoch
    stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c", incarnation=c.incarnation, role=pb.ROLE_JOINING),
               timeout=5)
    e = w.wait_for(2)
    assert [x.number for x in w.epochs] == [2] and e.number == 2  # epoch 1 was not resent


def test_unconfirmed_report_is_confirmed_once_the_suspect_stays_silent(
        pair: Any, watchers: Callable[..., Watcher]) -> None:
    s, stub, incs = pair
    w = watchers(stub, after=1)
    heartbeat(stub, "b", incs["b"])
    r = stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="a", reporter_incarnation=incs["a"],
                                            suspect_replica_id="b", epoch=1, reason="peer timed out"), timeout=5)
    assert not r.confirmed  # b heartbeated just now
    e2 = w.wait_for(2, timeout=5)  # b stays silent past confirm_age (1 s): the tick confirms
    assert [x.replica_id for x in e2.members] == ["a"] and "reported by a" in e2.reason
    # b's incarnation is over: it is told so (it must restart as a new incarnation), not to register again.
    code, detail = details_of(lambda: heartbeat(stub, "b", incs["b"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "declared dead" in detail
    # A second report about the dead b, under the current epoch, is refused: b is not a member of it.
    assert code_of(lambda: stub.ReportFailure(pb.FailureReport(
        job_id=JOB, reporter_replica_id="a", reporter_incarnation=incs["a"], suspect_replica_id="b", epoch=2),
        timeout=5)) == grpc.StatusCode.NOT_FOUND


def test_a_report_about_a_replica_whose_own_watch_closed_is_confirmed_at_once(
        pair: Any, watchers: Callable[..., Watcher]) -> None:
    s, stub, incs = pair
    w = watchers(stub, after=1)
    own = watchers(stub, replica=("b", incs["b"]))  # b's own stream, as its client opens it
    own.wait_for(1)

    def early() -> pb.FailureReportResponse:
        return stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="a", reporter_incarnation=incs["a"],
                                                   suspect_replica_id="b", epoch=1, reason="connection reset",
                                                   early=True), timeout=5)

    heartbeat(stub, "b", incs["b"])
    before = snapshot(stub)
    r = early()  # b's stream is open and it heartbeats: no evidence, nothing recorded
    assert not r.confirmed and "nothing recorded" in r.detail
    assert snapshot(stub) == before
    # A stream that closed and was replaced (a reconnect) is no evidence either.
    own.close()
    wait_until(lambda: s.on_loop(lambda: s.lh.jobs[JOB].disconnected_s("b", 0.0)) is not None, 5,
               what="b's closed stream to be recorded")
    again = watchers(stub, replica=("b", incs["b"]))
    again.wait_for(1)
    assert not early().confirmed and snapshot(stub) == before
    # b's end goes away for good (its process died: the kernel closes the connection; here its client cancels).
    again.close()
    confirmed = wait_until(lambda: (x := early()).confirmed and x, 5, what="the early report to be confirmed")
    assert confirmed.confirmed
    e2 = w.wait_for(2)
    assert [x.replica_id for x in e2.members] == ["a"] and "connection closed" in e2.reason, e2.reason
    # Heartbeats were fresh: the silence rule (confirm age 1 s) could not have confirmed it.
    assert "blamed by a" in e2.reason


def test_a_watch_naming_a_bad_replica_is_invalid_argument(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    for rid, inc in (("b b", incs["b"]), ("b", ""), ("b", "x" * 200)):
        call = stub.Watch(pb.WatchRequest(job_id=JOB, replica_id=rid, incarnation=inc), timeout=5)
        assert code_of(lambda: next(call)) == grpc.StatusCode.INVALID_ARGUMENT  # noqa: B023 (called at once)
    assert snapshot(stub) == before


def test_silent_member_dies_and_a_newcomer_restarts_the_job(server: ServerThread, stub: pb_grpc.LighthouseStub,
                                                            watchers: Callable[..., Watcher]) -> None:
    # FAST policy: 0.8 s heartbeat timeout. "a" never heartbeats after registering.
    registered = time.monotonic()
    register(stub, "a")
    w = watchers(stub)
    w.wait_for(1)
    wait_until(lambda: "a" not in server.state().members, timeout=5, what="a declared dead")
    assert time.monotonic() - registered >= 0.8  # not before the timeout
    # Alone, a's death leaves no one to form an epoch with: the guard keeps epoch 1.
    assert server.number() == 1 and [e.number for e in w.epochs] == [1]
    assert code_of(lambda: heartbeat(stub, "a", "whatever")) == grpc.StatusCode.NOT_FOUND
    # No live active member: a newcomer restarts the job (from a checkpoint) as active.
    c = register(stub, "c")
    assert c.role == pb.ROLE_ACTIVE and c.resume  # the job trained before: resume from a checkpoint
    e2 = w.wait_for(2)
    assert [(x.replica_id, x.role) for x in e2.members] == [("c", pb.ROLE_ACTIVE)]


def test_restart_with_new_incarnation_fences_the_old_one(pair: Any) -> None:
    s, stub, incs = pair
    new = register(stub, "b")
    assert new.incarnation != incs["b"] and new.role == pb.ROLE_JOINING
    st = status(stub)
    assert st.epoch.number == 2 and [x.replica_id for x in st.epoch.members] == ["a"]
    assert code_of(lambda: heartbeat(stub, "b", incs["b"])) == grpc.StatusCode.FAILED_PRECONDITION
    assert heartbeat(stub, "b", new.incarnation).epoch == 2
    # Reconnect: the same incarnation again changes nothing.
    before = snapshot(stub)
    again = register(stub, "b", incarnation=new.incarnation)
    assert again.incarnation == new.incarnation and snapshot(stub) == before


def test_jobs_are_independent(start_server: Callable[..., ServerThread],
                              channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    s = start_server(jobs=("alpha", "beta"))
    stub = pb_grpc.LighthouseStub(channel_to(s))
    register(stub, "a", job="alpha")
    register(stub, "b", job="alpha", incarnation="x1")
    assert status(stub, "alpha").epoch.number == 1
    assert status(stub, "beta").epoch.number == 0 and not status(stub, "beta").members
    r = register(stub, "a", job="beta")  # same replica id, other job: a separate member
    assert r.role == pb.ROLE_ACTIVE and r.epoch.number == 1 and r.epoch.job_id == "beta"
    assert [x.replica_id for x in status(stub, "beta").members] == ["a"]
    alpha = status(stub, "alpha")
    assert alpha.epoch.number == 1 and [x.replica_id for x in alpha.members] == ["a", "b"]


# --- bad input: a clear status, no state change, the server keeps serving ----------------------------------------


METHODS = ["Register", "Heartbeat", "ReportFailure", "Ready", "Leave", "Status"]
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80"]


@pytest.mark.parametrize("method", METHODS + ["Watch"])
def test_malformed_bytes_are_invalid_argument(pair: Any, channel_to: Callable[[ServerThread], grpc.Channel],
                                              method: str) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    channel = channel_to(s)
    for raw in GARBAGE:
        if method == "Watch":
            call = channel.unary_stream(f"/fthsdp.v1.Lighthouse/{method}")
            code, detail = details_of(lambda call=call, raw=raw: list(call(raw, timeout=5)))
        else:
            call = channel.unary_unary(f"/fthsdp.v1.Lighthouse/{method}")
            code, detail = details_of(lambda call=call, raw=raw: call(raw, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (raw, detail)
        assert "malformed" in detail
    assert snapshot(stub) == before
    assert heartbeat(stub, "a", incs["a"]).epoch == 1  # still serving


def test_oversized_message_is_resource_exhausted(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    huge = "x" * 100_000
    assert code_of(lambda: register(stub, "c", data_plane=huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(lambda: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation=incs["a"],
                                                      reason=huge), timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert snapshot(stub) == before
    # Just under the gRPC limit but over the field's limit: refused by validation instead.
    code, detail = details_of(lambda: register(stub, "c", data_plane="x" * (validate.ENDPOINT_MAX + 1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "endpoints.data_plane" in detail
    assert snapshot(stub) == before
    assert heartbeat(stub, "a", incs["a"]).epoch == 1


BAD_IDS = ["", "x" * 129, "has space", "a/b", "trailing\n", "-leading-dash", "ünïcode", "a\x00b", "tab\there"]


@pytest.mark.parametrize("rid", BAD_IDS, ids=[repr(r)[:20] for r in BAD_IDS])
def test_bad_replica_ids_are_invalid_argument(pair: Any, rid: str) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    code, detail = details_of(lambda: register(stub, rid))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "replica_id" in detail
    assert code_of(lambda: heartbeat(stub, rid, "i")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id=rid, incarnation="i",
                                                      role=pb.ROLE_JOINING), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.ReportFailure(pb.FailureReport(
        job_id=JOB, reporter_replica_id="a", reporter_incarnation=incs["a"], suspect_replica_id=rid, epoch=1),
        timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(stub) == before


def test_longest_valid_replica_id_is_accepted(pair: Any) -> None:
    s, stub, incs = pair
    rid = "r" * 128
    assert register(stub, rid).role == pb.ROLE_JOINING
    assert rid in [x.replica_id for x in status(stub).members]


def test_other_bad_register_fields(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    assert code_of(lambda: register(stub, "c", shard_count=0)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Register(pb.RegisterRequest(job_id=JOB, replica_id="c", shard_count=1),
                                         timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT  # no incarnation
    code, detail = details_of(lambda: register(stub, "c", shard_count=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shard_count" in detail  # job's is 1
    assert snapshot(stub) == before


def test_unknown_job_is_not_found(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    for call in (lambda: register(stub, "c", job="other"),
                 lambda: heartbeat(stub, "a", incs["a"], job="other"),
                 lambda: status(stub, "other"),
                 lambda: stub.Ready(pb.ReadyRequest(job_id="other", replica_id="a", incarnation=incs["a"],
                                                    role=pb.ROLE_ACTIVE), timeout=5),
                 lambda: stub.Leave(pb.LeaveRequest(job_id="other", replica_id="a", incarnation=incs["a"]),
                                    timeout=5),
                 lambda: list(stub.Watch(pb.WatchRequest(job_id="other"), timeout=5)),
                 lambda: register(stub, "c", job="x" * 5000)):
        code, detail = details_of(call)
        assert code == grpc.StatusCode.NOT_FOUND and "unknown job" in detail
        assert len(detail) < 400  # a huge job id is not echoed back whole
    assert snapshot(stub) == before


def test_heartbeat_refusals(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    code, detail = details_of(lambda: heartbeat(stub, "ghost", "i1"))
    assert code == grpc.StatusCode.NOT_FOUND and "register again" in detail
    assert code_of(lambda: heartbeat(stub, "a", "not-" + incs["a"])) == grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(stub) == before
    assert heartbeat(stub, "a", incs["a"]).epoch == 1


@pytest.mark.parametrize("digest", ["xyz", "0" * 65, "12 4"])
def test_a_malformed_digest_is_invalid_argument_and_changes_nothing(pair: Any, digest: str) -> None:
    s, stub, incs = pair
    heartbeat(stub, "a", incs["a"], digest=(10, "00aa"))
    before = json.loads(http_get(s.http, "/status")[2])["members"]
    code, detail = details_of(lambda: heartbeat(stub, "a", incs["a"], step=99, digest=(20, digest)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "digest" in detail
    after = json.loads(http_get(s.http, "/status")[2])["members"]
    assert [(x["step"], x["digest_step"], x["digest"]) for x in after] == \
        [(x["step"], x["digest_step"], x["digest"]) for x in before]


def test_digests_are_compared_in_one_case(pair: Any) -> None:
    s, stub, incs = pair
    heartbeat(stub, "a", incs["a"], digest=(10, "00AA00AA00AA00AA"))
    heartbeat(stub, "b", incs["b"], digest=(10, "00aa00aa00aa00aa"))
    doc = json.loads(http_get(s.http, "/status")[2])
    assert doc["members"][0]["digest"] == "00aa00aa00aa00aa" and doc["agreement"]["agree"] is True


@pytest.mark.parametrize("pace", [(12, float("nan"), 0.0), (12, -0.5, 0.0), (12, 0.1, 1e9), (12, float("inf"), 0.1)])
def test_a_malformed_pace_is_invalid_argument_and_changes_nothing(pair: Any, pace: tuple[int, float, float]) -> None:
    s, stub, incs = pair
    heartbeat(stub, "a", incs["a"], pace=(10, 0.1, 0.05))
    before = json.loads(http_get(s.http, "/status")[2])["members"]
    code, detail = details_of(lambda: heartbeat(stub, "a", incs["a"], step=99, pace=pace))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "compute_s" in detail
    after = json.loads(http_get(s.http, "/status")[2])["members"]
    assert [(x["step"], x["pace"]) for x in after] == [(x["step"], x["pace"]) for x in before]


@pytest.mark.parametrize("lanes", [b"\x01\x02\x03", b"\x00" * (2 * MAX_LANES + 2)], ids=["odd", "too-many"])
def test_malformed_lane_times_are_invalid_argument_and_change_nothing(pair: Any, lanes: bytes) -> None:
    s, stub, incs = pair
    heartbeat(stub, "a", incs["a"], pace=(10, 0.1, 0.05), lane_wait_ms=pack_lanes((0.01, 0.02)))
    before = json.loads(http_get(s.http, "/status")[2])["members"]
    code, detail = details_of(lambda: heartbeat(stub, "a", incs["a"], step=99, pace=(11, 0.1, 0.05),
                                                lane_wait_ms=lanes))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lane_wait_ms" in detail
    after = json.loads(http_get(s.http, "/status")[2])["members"]
    assert [(x["step"], x["pace"]) for x in after] == [(x["step"], x["pace"]) for x in before]
    assert before[0]["pace"]["lane_wait_s"] == [0.01, 0.02]


def test_lane_times_name_the_slow_link_with_its_rank(pair: Any) -> None:
    """Two members of two ranks: rank 1 of 'b' waits 0.2 s less inside its lane's collectives than rank 1 of 'a',
    with the same compute: after three reports, 'b' rank 1's link is named, in /status and gRPC Status."""
    s, stub, incs = pair
    for step in (10, 11, 12):
        heartbeat(stub, "a", incs["a"], pace=(step, 0.1, 0.21), lane_wait_ms=pack_lanes((0.01, 0.21)))
        heartbeat(stub, "b", incs["b"], pace=(step, 0.1, 0.21), lane_wait_ms=pack_lanes((0.01, 0.01)))
    doc = json.loads(http_get(s.http, "/status")[2])
    assert doc["stragglers"] == []
    assert [(x["replica_id"], x["rank"], x["reports"]) for x in doc["slow_links"]] == [("b", 1, 3)]
    assert "b rank 1's link is slow" in doc["slow_links"][0]["text"]
    assert [(x.replica_id, x.rank) for x in status(stub).slow_links] == [("b", 1)]


def test_paces_name_the_replica_the_others_wait_on(pair: Any) -> None:
    """Two members: 'a' reports three times the compute of 'b', and 'b' waits: 'a' is named once three reports of
    distinct steps hold it (a heartbeat repeating a report counts once)."""
    s, stub, incs = pair
    for step in (10, 11):
        heartbeat(stub, "a", incs["a"], pace=(step, 0.3, 0.0))
        heartbeat(stub, "a", incs["a"], pace=(step, 0.3, 0.0))
        heartbeat(stub, "b", incs["b"], pace=(step, 0.1, 0.2))
    assert json.loads(http_get(s.http, "/status")[2])["stragglers"] == []
    heartbeat(stub, "a", incs["a"], pace=(12, 0.3, 0.0))
    doc = json.loads(http_get(s.http, "/status")[2])
    assert [(x["replica_id"], x["slowdown"], x["since_step"], x["reports"]) for x in doc["stragglers"]] == \
        [("a", 3.0, 10, 3)]
    assert [(x.replica_id, x.reports) for x in status(stub).stragglers] == [("a", 3)]


def test_report_refusals(pair: Any) -> None:
    s, stub, incs = pair
    c = register(stub, "c")
    stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c", incarnation=c.incarnation, role=pb.ROLE_JOINING),
               timeout=5)
    assert status(stub).epoch.number == 2
    before = snapshot(stub)

    def rep(**kw: Any) -> Any:
        req = dict(job_id=JOB, reporter_replica_id="a", reporter_incarnation=incs["a"], suspect_replica_id="b",
                   epoch=2, reason="x")
        req.update(kw)
        return stub.ReportFailure(pb.FailureReport(**req), timeout=5)

    code, detail = details_of(lambda: rep(epoch=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale epoch" in detail
    assert code_of(lambda: rep(epoch=3)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: rep(suspect_replica_id="a")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: rep(reporter_incarnation="stale")) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: rep(suspect_replica_id="nobody")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: rep(reason="r" * (validate.REASON_MAX + 1))) == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(stub) == before


@pytest.mark.parametrize("role", [pb.ROLE_UNSPECIFIED, 7])
def test_bad_role_in_ready_is_invalid_argument(pair: Any, role: int) -> None:
    s, stub, incs = pair
    c = register(stub, "c")
    before = snapshot(stub)
    code, detail = details_of(lambda: stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c",
                                                                 incarnation=c.incarnation, role=role), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in detail
    assert snapshot(stub) == before


def test_ready_active_before_joining_is_failed_precondition(pair: Any) -> None:
    s, stub, incs = pair
    c = register(stub, "c")
    before = snapshot(stub)
    assert code_of(lambda: stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c", incarnation=c.incarnation,
                                                      role=pb.ROLE_ACTIVE), timeout=5)) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(stub) == before


def test_second_joiner_is_told_to_retry_while_one_syncs(pair: Any) -> None:
    s, stub, incs = pair
    c, d = register(stub, "c"), register(stub, "d")
    ready = lambda r, rid, role: stub.Ready(pb.ReadyRequest(  # noqa: E731
        job_id=JOB, replica_id=rid, incarnation=r.incarnation, role=role), timeout=5)
    assert ready(c, "c", pb.ROLE_JOINING).epoch == 2
    before = snapshot(stub)
    code, detail = details_of(lambda: ready(d, "d", pb.ROLE_JOINING))
    assert code == grpc.StatusCode.ABORTED and "retry" in detail
    assert snapshot(stub) == before
    assert ready(c, "c", pb.ROLE_ACTIVE).epoch == 3
    assert ready(d, "d", pb.ROLE_JOINING).epoch == 4


def test_register_refusals_of_the_relearning_fields(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    code, detail = details_of(lambda: stub.Register(pb.RegisterRequest(
        job_id=JOB, replica_id="z", incarnation="z1", shard_count=1, last_epoch=1 << 60), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "last_epoch" in detail
    code, detail = details_of(lambda: stub.Register(pb.RegisterRequest(
        job_id=JOB, replica_id="z", incarnation="z1", shard_count=1, role=7), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in detail
    assert snapshot(stub) == before


def test_leave_refusals(pair: Any) -> None:
    s, stub, incs = pair
    before = snapshot(stub)
    assert code_of(lambda: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation="old"),
                                      timeout=5)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="zz", incarnation="i"),
                                      timeout=5)) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation=incs["a"],
                                                      reason="r" * 2000), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(stub) == before


def test_refusals_are_counted_in_metrics(pair: Any) -> None:
    s, stub, incs = pair
    code_of(lambda: heartbeat(stub, "ghost", "i"))
    code_of(lambda: register(stub, "bad id"))
    _, _, text = http_get(s.http, "/metrics")

    def count(method: str, code: str) -> float:
        for line in text.splitlines():
            if (line.startswith("fthsdp_lighthouse_rpc_errors_total{") and f'method="{method}"' in line
                    and f'code="{code}"' in line):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert count("Heartbeat", "NOT_FOUND") == 1.0
    assert count("Register", "INVALID_ARGUMENT") == 1.0
    assert count("Register", "NOT_FOUND") == 0.0


# --- HTTP side port and reflection ------------------------------------------------------------------------------


def test_http_status_metrics_and_page(pair: Any) -> None:
    s, stub, incs = pair
    heartbeat(stub, "a", incs["a"], step=42, digest=(40, "00ff00ff00ff00ff"))
    heartbeat(stub, "b", incs["b"], step=41, digest=(40, "00ff00ff00ff00ff"))
    code, ctype, body = http_get(s.http, "/status")
    assert code == 200 and ctype.startswith("application/json")
    doc = json.loads(body)
    assert doc["epoch"] == 1 and doc["job"] == JOB
    assert [(x["replica_id"], x["role"]) for x in doc["members"]] == [("a", "active"), ("b", "active")]
    a = doc["members"][0]
    assert a["step"] == 42 and a["in_epoch"] is True
    assert (a["digest_step"], a["digest"]) == (40, "00ff00ff00ff00ff")
    assert doc["agreement"]["agree"] is True and doc["agreement"]["step"] == 40
    assert status(stub).agreement == "agree at step 40 (2 replicas)"
    assert isinstance(a["last_heartbeat_age_s"], float) and 0 <= a["last_heartbeat_age_s"] < 30
    assert len(doc["history"]) == 1
    h = doc["history"][0]
    assert h["epoch"] == 1 and h["members"] == ["a", "b"] and h["reason"]
    assert abs(h["time"] - time.time()) < 60

    code, ctype, text = http_get(s.http, "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert re.search(r'^fthsdp_lighthouse_epoch\{job="default"\} 1\.0$', text, re.M)
    assert re.search(r'^fthsdp_lighthouse_members\{job="default",role="active"\} 2\.0$', text, re.M)
    assert re.search(r"^fthsdp_lighthouse_heartbeats_total [1-9]", text, re.M)

    code, ctype, page = http_get(s.http, "/")
    assert code == 200 and ctype.startswith("text/html")
    # The page (lighthouse/page.py) draws itself with a script from the status it embeds, then from /status.
    embedded = re.search(r'<script type="application/json" id="initial-status">(.*?)</script>', page, re.S)
    assert embedded is not None
    shown = json.loads(embedded.group(1))
    assert shown["epoch"] == 1 and [x["replica_id"] for x in shown["members"]] == ["a", "b"]

    assert http_get(s.http, "/nope")[0] == 404


def test_server_reflection_lists_the_service(server: ServerThread,
                                             channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(channel_to(server))
    services = set(db.get_services())
    assert "fthsdp.v1.Lighthouse" in services
    fd = db.FindFileContainingSymbol("fthsdp.v1.Lighthouse")
    assert fd.name == "lighthouse/v1/lighthouse.proto"  # protos/lighthouse/v1 (the package stays fthsdp.v1)
    assert {x.name for x in fd.service[0].method} == set(METHODS) | {"Watch", "Session"}


# --- acceptance: real clients, one stops heartbeating -----------------------------------------------------------


def _client_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("lighthouse-")}


def test_survivors_get_the_pushed_epoch_within_heartbeat_timeout(
        start_server: Callable[..., ServerThread]) -> None:
    policy = m.Policy(min_replicas=1, expected_replicas=3, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0,
                      confirm_age_s=0.3)
    s = start_server(policy)
    threads_before = _client_threads()
    clients = {rid: LighthouseClient(s.addr, JOB, rid, rpc_timeout_s=2.0) for rid in ("r0", "r1", "r2")}
    try:
        for c in clients.values():
            c.start(deadline_s=10)
        for c in clients.values():
            first = c.wait_epoch(0, timeout=5)
            assert first is not None and first.replica_ids == ("r0", "r1", "r2")
        number = clients["r0"].epoch.number  # type: ignore[union-attr]
        assert number == 1

        stopped_at = time.monotonic()
        clients["r2"].close()  # stops heartbeating
        deadline = stopped_at + policy.heartbeat_timeout_s + 0.5
        for rid in ("r0", "r1"):
            e = clients[rid].wait_epoch(number, timeout=max(0.0, deadline - time.monotonic()))
            assert e is not None, f"{rid} got no new epoch within heartbeat timeout + 0.5 s"
            assert e.number > number and e.replica_ids == ("r0", "r1")
            assert "r2" in e.reason and "no heartbeat" in e.reason
        assert time.monotonic() <= deadline + 0.05
    finally:
        for c in clients.values():
            c.close()
    wait_until(lambda: _client_threads() <= threads_before, timeout=5, what="client threads to end")
    assert not any(t.is_alive() for c in clients.values() for t in [c._thread])


def test_status_lists_only_the_newest_epochs(pair: Any) -> None:
    from lighthouse.server.status import STATUS_HISTORY

    s, stub, incs = pair
    for _ in range(STATUS_HISTORY // 2 + 2):  # each cycle forms two epochs: c joins, then leaves
        inc = register(stub, "c").incarnation
        stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c", incarnation=inc, role=pb.ROLE_JOINING), timeout=5)
        stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="c", incarnation=inc, reason="test"), timeout=5)
    st = status(stub)
    assert st.epoch.number > STATUS_HISTORY + 1  # more epochs exist than are listed
    assert [h.epoch for h in st.history] == list(range(st.epoch.number - STATUS_HISTORY + 1, st.epoch.number + 1))
    doc = json.loads(http_get(s.http, "/status")[2])
    assert [h["epoch"] for h in doc["history"]] == [h.epoch for h in st.history]


def test_a_finished_job_stays_finished_across_a_restart_on_a_durable_store(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    store = InMemoryStore()
    first = start_server(PAIR, store=store)
    stub = pb_grpc.LighthouseStub(channel_to(first))
    incs = {rid: register(stub, rid).incarnation for rid in ("a", "b")}
    stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation=incs["a"], reason="finished", step=9),
               timeout=5)
    stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="b", incarnation=incs["b"], reason="finished", step=10),
               timeout=5)
    # The last leave formed no epoch (nobody is left): the end of the job was written all the same.
    assert store.load(JOB)["finished_step"] == 10  # type: ignore[index]
    doc = json.loads(http_get(first.http, "/status")[2])
    assert doc["finished_step"] == 10 and doc["members"] == []
    number = status(stub).epoch.number
    first.stop()
    second = start_server(PAIR, store=store)
    stub = pb_grpc.LighthouseStub(channel_to(second))
    resp = register(stub, "a")  # a restarted replica comes back
    assert resp.finished and resp.finished_step == 10 and resp.incarnation == "" and not resp.resume
    assert resp.role == pb.ROLE_UNSPECIFIED and resp.epoch.number == number
    assert "a" not in second.state().members  # not registered
    st = status(stub)
    assert st.finished and st.finished_step == 10 and st.epoch.number == number


def test_a_burst_of_calls_waits_for_a_busy_event_loop_instead_of_being_rejected(
        server: ServerThread, channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    """Thousands of groups open their sessions together (a job's start, a failover): gRPC's core holds the calls
    the event loop has not taken yet; beyond 1,000 (its default) it rejected them, which the clients saw as
    INTERNAL. 1,500 calls while the loop is busy: none is turned away, all are answered once it is free."""
    busy = threading.Event()
    server.loop.call_soon_threadsafe(busy.wait, 30)  # the loop is busy until released (bounded)
    stub = pb_grpc.LighthouseStub(channel_to(server))
    calls = [stub.Status.future(pb.StatusRequest(job_id=JOB), timeout=60) for _ in range(1500)]
    answered = threading.Event()
    for c in calls:
        c.add_done_callback(lambda _: answered.set())
    try:
        assert not answered.wait(3.0), "a call ended while the event loop had not taken it: turned away"
    finally:
        busy.set()
    codes = [c.exception().code() if c.exception() is not None else grpc.StatusCode.OK for c in calls]
    assert codes == [grpc.StatusCode.OK] * len(calls), {code.name: codes.count(code) for code in set(codes)}
