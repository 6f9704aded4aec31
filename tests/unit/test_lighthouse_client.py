"""The lighthouse clients (asyncio core, thread-backed wrapper) and the emulator, against an in-process server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from fthsdp.bench.emulate import Emulator
from fthsdp.testing.ports import free_port
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.client_rpc import parse_addresses
from lighthouse.client_session import AsyncLighthouseClient
from lighthouse.errors import FencedOut, InvalidRequest, LighthouseUnavailable, UnknownTarget
from lighthouse.stores.memory import InMemoryStore
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, ServerThread, register, wait_until


def test_parse_addresses() -> None:
    assert parse_addresses("h1:1, h2:2,") == ["h1:1", "h2:2"]
    assert parse_addresses(["h:1"]) == ["h:1"]
    with pytest.raises(ValueError):
        parse_addresses(" , ")


def test_superseded_incarnation_stops_heartbeating(slow_server: ServerThread,
                                                   slow_stub: pb_grpc.LighthouseStub) -> None:
    lost: list[str] = []

    async def scenario() -> None:
        client = AsyncLighthouseClient(slow_server.addr, JOB, "r", incarnation="old")
        try:
            await client.register()
            newer = register(slow_stub, "r", incarnation="new")  # the replica restarted elsewhere
            assert newer.incarnation == "new"
            stop = asyncio.Event()
            loop_task = asyncio.create_task(
                client._heartbeat_loop(lambda: 0, {"n": 0}, stop, lost.append, lambda e: None))
            # The loop ends by itself: registering "old" again would evict "new" (and so on, forever).
            await asyncio.wait_for(loop_task, timeout=5)
        finally:
            await client.close()

    asyncio.run(scenario())
    assert len(lost) == 1 and "FAILED_PRECONDITION" in lost[0]
    assert slow_server.state().members["r"].incarnation == "new"


def test_declared_dead_client_registers_again_and_is_told(slow_server: ServerThread,
                                                          slow_stub: pb_grpc.LighthouseStub) -> None:
    stub = slow_stub
    lost: list[str] = []
    c = LighthouseClient(slow_server.addr, JOB, "r", on_lost=lost.append)
    try:
        reg = c.start(deadline_s=10)
        assert reg is not None and reg.role == m.ACTIVE and reg.epoch.number == 1
        o = register(stub, "o")
        for role in (pb.ROLE_JOINING, pb.ROLE_ACTIVE):
            stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="o", incarnation=o.incarnation, role=role), timeout=5)
        e3 = c.wait_epoch(2, timeout=5)
        assert e3 is not None and e3.number == 3 and e3.replica_ids == ("o", "r")
        # The lighthouse forgets r (as after a death verdict): r's next heartbeat is NOT_FOUND.
        stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="r", incarnation=c.incarnation, reason="forced"),
                   timeout=5)
        e4 = c.wait_epoch(3, timeout=5)
        assert e4 is not None and e4.replica_ids == ("o",)
        # It registers again, as a joiner (o holds the state), and the runtime is told.
        member = wait_until(lambda: slow_server.state().members.get("r"), timeout=5, what="r registered again")
        assert member.role == m.JOINING and member.incarnation == c.incarnation and not member.in_epoch
        assert lost and "NOT_FOUND" in lost[0]
    finally:
        c.close()


def test_close_right_after_start_is_prompt_and_leaves_no_thread(server: ServerThread) -> None:
    for i in range(5):
        c = LighthouseClient(server.addr, JOB, f"quick{i}")
        c.start(deadline_s=10)
        started = time.monotonic()
        c.close()
        assert time.monotonic() - started < 2.0
        assert not c._thread.is_alive()
        c.close()  # idempotent


def test_client_errors_are_typed(server: ServerThread) -> None:
    clients: list[LighthouseClient] = []

    def make(**kw: Any) -> LighthouseClient:
        c = LighthouseClient(kw.pop("addr", server.addr), kw.pop("job", JOB), kw.pop("rid", "r"), **kw)
        clients.append(c)
        return c

    try:
        with pytest.raises(UnknownTarget):
            make(job="nope").start(deadline_s=5)
        with pytest.raises(InvalidRequest):
            make(rid="bad id").start(deadline_s=5)
        started = time.monotonic()
        with pytest.raises(LighthouseUnavailable):
            make(addr=f"127.0.0.1:{free_port()}", rpc_timeout_s=0.5).start(deadline_s=1.0)
        assert time.monotonic() - started < 5.0
        good = make(rid="good")
        good.start(deadline_s=5)
        epoch = good.wait_epoch(0, timeout=5)
        assert epoch is not None
        with pytest.raises(FencedOut):
            good.report_failure("other", epoch.number - 1, "a stale epoch")
        with pytest.raises(InvalidRequest):
            good.report_failure("good", epoch.number, "self")
    finally:
        for c in clients:
            c.close()


def test_client_follows_a_lighthouse_restart_on_a_durable_store(start_server: Callable[..., ServerThread],
                                                                channel_to: Callable[[ServerThread], grpc.Channel]
                                                                ) -> None:
    policy = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, confirm_age_s=1.0)
    store = InMemoryStore()
    port = free_port()
    first = start_server(policy, store=store, bind=f"127.0.0.1:{port}")
    c = LighthouseClient(f"127.0.0.1:{port}", JOB, "r")
    try:
        c.start(deadline_s=10)
        assert c.wait_epoch(0, timeout=5) is not None
        first.stop()
        second = start_server(policy, store=store, bind=f"127.0.0.1:{port}")
        # The client keeps its incarnation; its heartbeats land on the new lighthouse.
        wait_until(lambda: second.on_loop(lambda: "r" in second.lh.jobs[JOB].steps), timeout=10,
                   what="a heartbeat on the restarted lighthouse")
        stub = pb_grpc.LighthouseStub(channel_to(second))
        j = register(stub, "j")
        stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="j", incarnation=j.incarnation, role=pb.ROLE_JOINING),
                   timeout=5)
        e = c.wait_epoch(1, timeout=10)  # pushed over the re-established watch
        assert e is not None and e.number == 2 and e.replica_ids == ("j", "r")
    finally:
        c.close()


def test_emulator_replicas_see_a_death(start_server: Callable[..., ServerThread]) -> None:
    policy = m.Policy(min_replicas=1, expected_replicas=5, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0,
                      confirm_age_s=0.3)
    s = start_server(policy)

    async def scenario() -> None:
        emu = Emulator(s.addr, 5, prefix="emu")
        try:
            await emu.start()
            assert await emu.wait_all_have(lambda e: len(e.members) == 5, timeout=10)
            victim, reporter = emu.replicas[-1], emu.replicas[0]
            before = reporter.epoch.number  # type: ignore[union-attr]
            await emu.kill(victim)
            result = await emu.report(reporter, victim)
            assert result is not None and result.epoch >= before
            assert await emu.wait_all_have(
                lambda e: e.number > before and e.member(victim.replica_id) is None, timeout=5)
            assert all(r.epoch is not None and len(r.epoch.members) == 4 for r in emu.alive())
            # Joiners are made active by the emulator once they are in an epoch; the lighthouse lets one sync at
            # a time and tells the others to retry, so three late joiners get in one after the other.
            late = Emulator(s.addr, 3, prefix="late")
            try:
                await late.start()
                ids = [r.replica_id for r in late.replicas]
                assert await late.wait_all_have(
                    lambda e: all((x := e.member(rid)) is not None and x.role == m.ACTIVE for rid in ids),
                    timeout=20)
            finally:
                await late.close()
        finally:
            await emu.close()

    asyncio.run(scenario())
    assert not [t for t in threading.enumerate() if t.name.startswith("lighthouse-") and t.name != "lighthouse-http"]
