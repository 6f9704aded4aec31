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
from lighthouse.client_rpc import Registration, parse_addresses
from lighthouse.client_session import AsyncLighthouseClient
from lighthouse.errors import FencedOut, InvalidRequest, JobOver, LighthouseUnavailable, StoreUnavailable, UnknownTarget
from lighthouse.stores.memory import InMemoryStore
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, ServerThread, heartbeat, register, status, wait_until


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


def _count_registers(c: LighthouseClient) -> list[tuple[str, int]]:
    """Record every Register the client's session sends from now on: (claimed role, last epoch)."""
    sent: list[tuple[str, int]] = []
    real = c.aio.register

    async def counting(claim: str = "", last_epoch: int = 0) -> Registration:
        sent.append((claim, last_epoch))
        return await real(claim, last_epoch)

    c.aio.register = counting  # type: ignore[method-assign]
    return sent


def test_a_dropped_incarnation_is_over_the_client_says_so_and_never_registers_it_again(
        slow_server: ServerThread, slow_stub: pb_grpc.LighthouseStub) -> None:
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
        sent = _count_registers(c)
        # The lighthouse is done with r's incarnation (as after a death verdict).
        stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="r", incarnation=c.incarnation, reason="forced"),
                   timeout=5)
        e4 = c.wait_epoch(3, timeout=5)
        assert e4 is not None and e4.replica_ids == ("o",)
        wait_until(lambda: lost, timeout=5, what="on_lost")
        assert "FAILED_PRECONDITION" in lost[0] and "declared dead or left" in lost[0]
        assert sent == [] and "r" not in slow_server.state().members  # the session ended: nothing more is sent
        # Even by hand, the lighthouse refuses that incarnation back.
        with pytest.raises(grpc.RpcError) as info:
            register(stub, "r", incarnation=c.incarnation)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    finally:
        c.close()


def test_a_hung_then_continued_client_is_told_at_once_and_never_registers_the_dead_incarnation(
        server: ServerThread) -> None:
    # FAST policy: 0.8 s heartbeat timeout. The client's event loop is blocked (the process "hangs": no
    # heartbeats), the lighthouse declares it dead, then it continues.
    lost: list[tuple[float, str]] = []
    c = LighthouseClient(server.addr, JOB, "h", on_lost=lambda why: lost.append((time.monotonic(), why)))
    gate = threading.Event()
    try:
        c.start(deadline_s=10)
        assert c.wait_epoch(0, timeout=5) is not None
        sent = _count_registers(c)
        c._loop.call_soon_threadsafe(gate.wait, 30)  # the hang: the loop thread is stuck until the gate opens
        wait_until(lambda: "h" not in server.state().members, timeout=5, what="h declared dead")
        resumed = time.monotonic()
        gate.set()
        wait_until(lambda: lost, timeout=5, what="on_lost after the hang")
        at, why = lost[0]
        assert at - resumed < 2.0 and "FAILED_PRECONDITION" in why  # at its first heartbeat, not after a wait
        assert sent == [] and len(lost) == 1
        assert "h" not in server.state().members and server.state().is_departed("h", c.incarnation)
    finally:
        gate.set()
        c.close()


class FlakyStore(InMemoryStore):
    """An in-memory store whose next ``fail`` writes are refused as unavailable (an etcd hiccup)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = 0

    def save(self, job_id: str, expected_last_number: int, document: dict[str, Any]) -> None:
        if self.fail:
            self.fail -= 1
            raise StoreUnavailable("injected: etcd did not answer")
        super().save(job_id, expected_last_number, document)


def test_a_failed_ready_active_is_retried_until_the_lighthouse_takes_it(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    store = FlakyStore()
    port = free_port()
    s = start_server(m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0,
                              confirm_age_s=1.0), store=store, bind=f"127.0.0.1:{port}")
    register(pb_grpc.LighthouseStub(channel_to(s)), "a")
    j = LighthouseClient(f"127.0.0.1:{port}", JOB, "j")
    try:
        reg = j.start(deadline_s=10)
        assert reg is not None and reg.role == m.JOINING
        j.ready(m.JOINING)
        assert s.state().members["j"].in_epoch
        store.fail = 1  # the lighthouse answers the next Ready UNAVAILABLE (its store write failed)
        with pytest.raises(LighthouseUnavailable):
            j.ready(m.ACTIVE)
        # The refusal came from the store write (not read here as "still joining": the session may already be
        # retrying it after its next heartbeat, 0.1 s later).
        assert store.fail == 0
        # Nobody calls ready() again: the session retries it, and the joiner turns active.
        e = wait_until(lambda: (x := j.epoch) is not None and x.member("j") is not None
                       and x.member("j").role == m.ACTIVE and x, timeout=5, what="j active")  # type: ignore[union-attr]
        assert "caught up, now active" in e.reason and s.state().members["j"].role == m.ACTIVE
    finally:
        j.close()


def test_a_ready_active_lost_to_a_lighthouse_restart_is_retried_on_the_new_one(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    policy = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, confirm_age_s=1.0)
    store = InMemoryStore()  # durable across the restart
    port = free_port()
    first = start_server(policy, store=store, bind=f"127.0.0.1:{port}")
    register(pb_grpc.LighthouseStub(channel_to(first)), "a")
    j = LighthouseClient(f"127.0.0.1:{port}", JOB, "j", rpc_timeout_s=0.5)
    try:
        j.start(deadline_s=10)
        j.ready(m.JOINING)
        first.stop()  # the lighthouse is down when the joiner has caught up
        with pytest.raises(LighthouseUnavailable):
            j.ready(m.ACTIVE)
        second = start_server(policy, store=store, bind=f"127.0.0.1:{port}")
        wait_until(lambda: (x := second.state().members.get("j")) is not None and x.role == m.ACTIVE, timeout=10,
                   what="j active on the restarted lighthouse")
    finally:
        j.close()


def test_a_restarted_lighthouse_relearns_its_members_and_numbers_go_on(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    # The default in-memory store: the restarted lighthouse forgets everything. Its members register again with
    # the roles they hold, and a new epoch of both forms above the numbers they saw; no one is told it is lost.
    policy = m.Policy(min_replicas=1, expected_replicas=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0,
                      confirm_age_s=0.5)
    port = free_port()
    first = start_server(policy, bind=f"127.0.0.1:{port}")
    lost: list[str] = []
    clients = [LighthouseClient(f"127.0.0.1:{port}", JOB, rid, on_lost=lost.append) for rid in ("a", "b")]
    try:
        for c in clients:
            c.start(deadline_s=10)
        stub = pb_grpc.LighthouseStub(channel_to(first))
        x = register(stub, "x")  # a joiner comes and goes: epochs 2 and 3
        stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="x", incarnation=x.incarnation, role=pb.ROLE_JOINING),
                   timeout=5)
        stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="x", incarnation=x.incarnation), timeout=5)
        for c in clients:
            e = c.wait_epoch(2, timeout=5)
            assert e is not None and e.number == 3 and e.replica_ids == ("a", "b")
        incarnations = [c.incarnation for c in clients]
        first.stop()
        second = start_server(policy, bind=f"127.0.0.1:{port}")  # a fresh in-memory store
        for c in clients:
            e = c.wait_epoch(3, timeout=10)
            assert e is not None and e.number == 4, e  # numbering goes on above what the members saw
            assert [(y.replica_id, y.incarnation, y.role) for y in e.members] == [
                ("a", incarnations[0], m.ACTIVE), ("b", incarnations[1], m.ACTIVE)]
            assert "registered again as active" in e.reason
        assert lost == [] and [c.incarnation for c in clients] == incarnations
        assert second.number() == 4
    finally:
        for c in clients:
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


def test_after_the_job_finished_a_registration_is_told_so_with_the_final_step(
        slow_server: ServerThread, slow_stub: pb_grpc.LighthouseStub) -> None:
    c = LighthouseClient(slow_server.addr, JOB, "a")
    try:
        reg = c.start(deadline_s=10)
        assert reg is not None and reg.role == m.ACTIVE and not reg.finished and reg.finished_step == 0
        joiner = LighthouseClient(slow_server.addr, JOB, "j")  # a joiner in flight
        j = joiner.start(deadline_s=10)
        assert j.role == m.JOINING and not j.finished
        c.set_step(42)
    finally:
        c.close(leave="finished")  # sends the last step
    assert slow_server.state().finished_step == 42
    # The joiner had nothing left to join: dropped, and its heartbeat says why.
    with pytest.raises(grpc.RpcError) as info:
        heartbeat(slow_stub, "j", j.incarnation)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "finished at step 42" in info.value.details()  # type: ignore[attr-defined]
    # Its Ready (it asks to enter the data plane after the end) is refused with the step, typed: it takes the final
    # checkpoint in place (``fthsdp.runtime.roles.finished_meanwhile``).
    with pytest.raises(JobOver, match="finished at step 42") as over:
        joiner.ready(m.JOINING)
    assert over.value.step == 42
    joiner.close()

    async def come_back() -> Registration:  # a restarted a, as a new incarnation
        client = AsyncLighthouseClient(slow_server.addr, JOB, "a")
        try:
            return await client.register()
        finally:
            await client.close()

    later = asyncio.run(come_back())
    assert later.finished and later.finished_step == 42 and later.incarnation == "" and not later.resume
    assert slow_server.state().members == {}
    st = status(slow_stub)
    assert st.finished and st.finished_step == 42


def test_a_dropped_incarnation_never_claims_its_role_back_from_a_lighthouse_that_forgot(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    """Found by the simulator (docs/chaos.md): a replica that saw an epoch drop it, and whose next heartbeat finds
    a lighthouse that lost its state (in-memory store, restarted), must end its incarnation, not re-register with
    the role it held (it would be taken back, before the new lighthouse's first epoch, with a state that fell
    behind). Heartbeats every 5 s leave the drop and the restart well inside one interval."""
    policy = m.Policy(min_replicas=1, heartbeat_interval_s=5.0, heartbeat_timeout_s=30.0, confirm_age_s=10.0)
    port = free_port()
    first = start_server(policy, store=InMemoryStore(), bind=f"127.0.0.1:{port}")
    lost: list[str] = []
    c = LighthouseClient(f"127.0.0.1:{port}", JOB, "r", on_lost=lost.append)
    try:
        reg = c.start(deadline_s=10)
        assert reg is not None and reg.role == m.ACTIVE and c.wait_epoch(0, timeout=5) is not None
        stub = pb_grpc.LighthouseStub(channel_to(first))
        o = register(stub, "o")  # a second active member, so that an epoch forms without r
        for role in (pb.ROLE_JOINING, pb.ROLE_ACTIVE):
            stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="o", incarnation=o.incarnation, role=role), timeout=5)
        both = c.wait_epoch(2, timeout=5)
        assert both is not None and both.replica_ids == ("o", "r")
        stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="r", incarnation=c.incarnation, reason="forced"),
                   timeout=5)
        dropped = c.wait_epoch(both.number, timeout=5)
        assert dropped is not None and dropped.replica_ids == ("o",)
        first.stop()
        second = start_server(policy, store=InMemoryStore(), bind=f"127.0.0.1:{port}")
        wait_until(lambda: lost, timeout=15, what="on_lost")
        assert "dropped from epoch" in lost[0], lost
        assert "r" not in second.state().members  # it never registered again
    finally:
        c.close()
