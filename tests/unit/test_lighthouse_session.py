"""The replica group's session (``Lighthouse.Session``): heartbeats up on one stream, epochs down as deltas;
refusals end it with Heartbeat's codes; its end from the replica's side confirms a reported death at once; a
client falls back to unary heartbeats and a watch stream when the lighthouse has no sessions."""

from __future__ import annotations

import asyncio
import queue
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.events import DeathCause, Died
from lighthouse.server.service import LighthouseService
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import FAST_POLICY, JOB, SLOW_POLICY, ServerThread, heartbeat, register, wait_until


class RawSession:
    """A session driven by hand: ``send`` puts a message on the stream, ``next`` takes the next push."""

    def __init__(self, stub: pb_grpc.LighthouseStub, timeout: float = 10.0) -> None:
        self._out: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self.call = stub.Session(self._requests(), timeout=timeout)

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while (req := self._out.get()) is not None:
            yield req

    def send(self, rid: str, inc: str, *, after: int = 0, resync: bool = False, job: str = JOB,
             step: int = 0) -> None:
        self._out.put(pb.SessionRequest(heartbeat=pb.HeartbeatRequest(job_id=job, replica_id=rid, incarnation=inc,
                                                                      step=step),
                                        after_epoch=after, resync=resync))

    def next(self) -> pb.SessionUpdate:
        return next(self.call)

    def close(self) -> None:
        self._out.put(None)


def _epoch_number(u: pb.SessionUpdate) -> int:
    return u.epoch.number if u.WhichOneof("update") == "epoch" else u.delta.number


PAIR = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.8, confirm_age_s=0.3,
                expected_replicas=2)


def test_heartbeats_on_the_session_keep_a_member_alive_and_epochs_come_as_deltas(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    server = start_server(PAIR)
    stub = pb_grpc.LighthouseStub(channel_to(server))
    a, b = register(stub, "a"), register(stub, "b")
    s = RawSession(stub)
    try:
        s.send("a", a.incarnation)
        first = s.next()
        assert first.WhichOneof("update") == "epoch" and {x.replica_id for x in first.epoch.members} == {"a", "b"}
        held = first.epoch.number
        # "a" lives on its session's heartbeats alone (no unary call), far past the 0.8 s timeout; "b" is silent.
        deadline = time.monotonic() + 3 * FAST_POLICY.heartbeat_timeout_s
        update = None
        while time.monotonic() < deadline:
            s.send("a", a.incarnation)
            time.sleep(FAST_POLICY.heartbeat_interval_s)  # the heartbeat period (a pace, not a synchronisation)
            state = server.state()
            if "b" not in state.members and state.epoch is not None and state.epoch.number > held:
                break
        state = server.state()
        assert "a" in state.members and "b" not in state.members
        update = s.next()
        while _epoch_number(update) < state.epoch.number:
            update = s.next()
        assert update.WhichOneof("update") == "delta"
        assert update.delta.base == held and list(update.delta.removed) == ["b"] and not update.delta.upserted
        # A resync (the replica holds something else): the full epoch.
        s.send("a", a.incarnation, resync=True)
        full = s.next()
        assert full.WhichOneof("update") == "epoch" and [x.replica_id for x in full.epoch.members] == ["a"]
    finally:
        s.close()
    assert b.incarnation


@pytest.mark.parametrize("who", ["unknown", "other-replica", "bad-id"])
def test_a_refused_session_ends_with_a_clear_status_and_changes_nothing(
        slow_server: ServerThread, slow_stub: pb_grpc.LighthouseStub, who: str) -> None:
    a = register(slow_stub, "a")
    before = slow_server.state()
    s = RawSession(slow_stub)
    if who == "unknown":
        s.send("zz", "nope")
        code = grpc.StatusCode.NOT_FOUND
    elif who == "bad-id":
        s.send("a b", a.incarnation)
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        s.send("a", a.incarnation)
        s.next()
        s.send("b", "x")  # a session speaks for one replica only
        code = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        while True:
            s.next()
    assert e.value.code() == code  # type: ignore[attr-defined]
    s.close()
    assert slow_server.state().members.keys() == before.members.keys()


def test_a_suspect_whose_session_closes_is_confirmed_dead_at_once(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    slow_server = start_server(m.Policy(min_replicas=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0,
                                        confirm_age_s=10.0, expected_replicas=2))
    slow_stub = pb_grpc.LighthouseStub(channel_to(slow_server))
    a, b = register(slow_stub, "a"), register(slow_stub, "b")
    own = pb_grpc.LighthouseStub(channel_to(slow_server))  # b's own connection
    s = RawSession(own)
    s.send("b", b.incarnation)
    epoch = s.next().epoch.number
    # Reported while its session is open and it heartbeats: not confirmed (SLOW_POLICY confirms after 10 s).
    r = slow_stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="a",
                                                 reporter_incarnation=a.incarnation, suspect_replica_id="b",
                                                 epoch=epoch, reason="lane timeout"), timeout=5)
    assert not r.confirmed
    s.call.cancel()  # its process dies: the connection closes
    state = wait_until(lambda: (st := slow_server.state()).epoch.member("b") is None and st, timeout=5,
                       what="b's death confirmed by its closed session")
    died = [e for e in state.epoch.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause) for e in died] == [("b", DeathCause.DISCONNECTED)]


def test_a_client_falls_back_to_unary_heartbeats_and_a_watch_on_a_lighthouse_without_sessions(
        start_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    real = LighthouseService.handlers

    def without_session(self: LighthouseService) -> Any:
        h = real(self)
        methods = h._method_handlers  # type: ignore[attr-defined]
        methods.pop("/fthsdp.v1.Lighthouse/Session")
        return h

    monkeypatch.setattr(LighthouseService, "handlers", without_session)
    server = start_server(PAIR)
    clients = [LighthouseClient(server.addr, JOB, rid) for rid in ("a", "b")]
    try:
        for c in clients:
            c.start(deadline_s=10)
        e = clients[0].wait_epoch(0, 10)
        assert e is not None and set(e.replica_ids) == {"a", "b"}
        wait_until(lambda: clients[0].aio.heartbeats > 10, timeout=10, what="unary heartbeats")
        assert {"a", "b"} <= server.state().members.keys()  # alive past the timeout on unary heartbeats
        assert server.on_loop(lambda: server.lh.metrics.watchers._value.get()) == 2  # and watching apart
    finally:
        for c in clients:
            c.close()


def test_the_sessions_are_counted_one_per_replica_and_close_with_them(server: ServerThread) -> None:
    async def scenario() -> None:
        from lighthouse.client_session import AsyncLighthouseClient

        clients = [AsyncLighthouseClient(server.addr, JOB, f"r{i}") for i in range(3)]
        stops = [asyncio.Event() for _ in clients]
        tasks = []
        for c, stop in zip(clients, stops, strict=True):
            await c.register()
            tasks.append(asyncio.create_task(c.run(lambda e: None, stop, ranks=8)))
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while server.on_loop(lambda: server.lh.metrics.sessions._value.get()) != 3:
            assert loop.time() < end, "three sessions did not open"
            await asyncio.sleep(0.01)  # polling a condition with a deadline
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks)
        for c in clients:
            await c.close()
        end = loop.time() + 5
        while server.on_loop(lambda: server.lh.metrics.sessions._value.get()) != 0:
            assert loop.time() < end, "the sessions did not close"
            await asyncio.sleep(0.01)  # polling a condition with a deadline

    asyncio.run(scenario())
    assert SLOW_POLICY.heartbeat_timeout_s > FAST_POLICY.heartbeat_timeout_s


def test_a_client_handed_a_delta_against_another_epoch_asks_for_the_full_one_and_gets_it(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    server = start_server(PAIR)
    stub = pb_grpc.LighthouseStub(channel_to(server))
    c = LighthouseClient(server.addr, JOB, "a")
    try:
        c.start(deadline_s=10)
        register(stub, "b")
        first = c.wait_epoch(0, 10)
        assert first is not None and set(first.replica_ids) == {"a", "b"}
        job = server.lh.jobs[JOB]
        real, asked = job.update_for, []

        def wrong_base(held: int) -> bytes:  # the next delta names an epoch the client never held
            asked.append(held)
            if held:
                raw = pb.SessionUpdate.FromString(real(held))
                raw.delta.base = held + 1000
                return raw.SerializeToString()
            return real(held)

        server.on_loop(lambda: setattr(job, "update_for", wrong_base))
        server.call(server.lh.edge.apply(job, m.Leave("b", server.state().members["b"].incarnation, "done",
                                                      time.time())))
        e = c.wait_epoch(first.number, 10)
        assert e is not None and e.replica_ids == ("a",)  # from the full epoch the resync brought
        assert asked[0] == first.number and 0 in asked
    finally:
        c.close()


@pytest.mark.parametrize("listening", [False, True], ids=["endpoint-refuses", "endpoint-answers"])
def test_a_closed_session_whose_endpoint_refuses_is_dead_at_once_and_one_that_answers_is_not(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel],
        listening: bool) -> None:
    # Nobody reports it and its silence would take 30 s: only the probe of its catch-up endpoint can decide.
    server = start_server(m.Policy(min_replicas=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0,
                                   confirm_age_s=10.0, expected_replicas=2))
    stub = pb_grpc.LighthouseStub(channel_to(server))
    with socket.socket() as endpoint:
        endpoint.bind(("127.0.0.1", 0))  # bound, not listening: a connection to it is refused
        if listening:
            endpoint.listen()
            endpoint.settimeout(10)
        register(stub, "a")
        b = register(stub, "b", catchup=f"127.0.0.1:{endpoint.getsockname()[1]}")
        s = RawSession(pb_grpc.LighthouseStub(channel_to(server)))  # b's own connection
        s.send("b", b.incarnation)
        s.next()
        s.call.cancel()  # the connection closes, as when its process dies
        if listening:
            probe, _ = endpoint.accept()  # the lighthouse's probe connected: b's process lives
            probe.close()
            state = server.state()
            assert state.epoch is not None and state.epoch.member("b") is not None and "b" in state.members
            return
        state = wait_until(lambda: (st := server.state()).epoch.member("b") is None and st, timeout=5,
                           what="b declared dead by its closed session and refused endpoint")
    died = [e for e in state.epoch.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause) for e in died] == [("b", DeathCause.GONE)]
    assert "endpoint refused" in state.epoch.reason


def test_no_probe_when_it_is_off(start_server: Callable[..., ServerThread],
                                 channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    server = start_server(m.Policy(min_replicas=1, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5,
                                   confirm_age_s=1.0, expected_replicas=2), probe_timeout_s=0.0)
    stub = pb_grpc.LighthouseStub(channel_to(server))
    with socket.socket() as endpoint:
        endpoint.bind(("127.0.0.1", 0))  # refuses connections
        a = register(stub, "a")
        b = register(stub, "b", catchup=f"127.0.0.1:{endpoint.getsockname()[1]}")
        s = RawSession(pb_grpc.LighthouseStub(channel_to(server)))
        s.send("b", b.incarnation)
        s.next()
        s.call.cancel()
        # "a" heartbeats; b is not probed, so only its silence (1.5 s) ends it: a timeout, not GONE.
        deadline = time.monotonic() + 10
        while (state := server.state()).epoch.member("b") is not None and time.monotonic() < deadline:
            heartbeat(stub, "a", a.incarnation)
            time.sleep(0.1)  # the heartbeat period (a pace, not a synchronisation)
    assert state.epoch.member("b") is None, "b was never declared dead"
    died = [(e.replica_id, e.cause) for e in state.epoch.events if isinstance(e, Died)]
    assert died == [("b", DeathCause.TIMEOUT)]
