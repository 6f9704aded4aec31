"""Several lighthouses on one real etcd: one leads, the others refuse naming the leader, a dead leader is replaced,
clients follow on their own, members survive the failover, and epoch numbers never go back or get reused —
across graceful stops and SIGKILLs of lighthouse processes alike."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from fthsdp.launch.lighthouse_process import start_lighthouse_process
from fthsdp.launch.procutil import stop_process
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.security import LEADER_METADATA
from lighthouse.stores.factory import open_store
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, ServerThread, register, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
TTL = 2  # the election lease: the shortest etcd grants
# Liveness relaxed enough that a failover (lease expiry plus the clients' backoff) does not kill anyone.
HA_POLICY = m.Policy(min_replicas=1, heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, confirm_age_s=1.0)


def http_status(addr: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{addr}/status", timeout=5) as r:
        return json.load(r)  # type: ignore[no-any-return]


@pytest.fixture
def ha_pair(start_server: Callable[..., ServerThread], etcd_server: Any) -> tuple[ServerThread, ServerThread]:
    """Two in-process lighthouses on one etcd prefix; the first started leads."""
    url = etcd_server.url()
    first = start_server(HA_POLICY, store=open_store(url), election_ttl_s=TTL)
    assert first.lh.leading  # a lone candidate leads as soon as start() returns
    second = start_server(HA_POLICY, store=open_store(url), election_ttl_s=TTL)
    assert not second.lh.leading and second.lh.leader_address == first.addr
    return first, second


def test_follower_refuses_naming_the_leader_and_status_says_who_leads(
        ha_pair: tuple[ServerThread, ServerThread], channel_to: Callable[[ServerThread], grpc.Channel]) -> None:
    first, second = ha_pair
    leader = pb_grpc.LighthouseStub(channel_to(first))
    register(leader, "a")
    follower = pb_grpc.LighthouseStub(channel_to(second))
    for call in (lambda: register(follower, "b"),
                 lambda: follower.Status(pb.StatusRequest(job_id=JOB), timeout=5),
                 lambda: next(follower.Watch(pb.WatchRequest(job_id=JOB), timeout=5))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        e = info.value
        assert e.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert first.addr in e.details()  # type: ignore[attr-defined]
        assert dict(e.trailing_metadata())[LEADER_METADATA] == first.addr  # type: ignore[attr-defined]
    assert set(first.state().members) == {"a"}  # the refused registration went nowhere
    s1, s2 = http_status(first.http), http_status(second.http)
    assert s1["leader"] is True and s2["leader"] is False and s2["leader_address"] == first.addr
    assert s1["epoch"] == s2["epoch"] == 1  # a follower reports what the store holds
    # One client call reaches the leader through the follower's hint, skipping the address list's order
    # (rotation alone would go to the dead address next and fail this call).
    from fthsdp.testing.ports import free_port
    c = LighthouseClient(f"{second.addr},127.0.0.1:{free_port()},{first.addr}", JOB, "probe")
    try:
        assert c.status().epoch.number == 1 and c.aio.address == first.addr
    finally:
        c.close()
    # `fthsdp status` given both side ports shows the leader's answer.
    out = subprocess.run([sys.executable, "-m", "fthsdp", "status", "--json", "--http",
                          f"{second.http},{first.http}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["address"] == first.addr
    with urllib.request.urlopen(f"http://{second.http}/metrics", timeout=5) as r:
        assert "fthsdp_lighthouse_leader 0.0" in r.read().decode()
    with urllib.request.urlopen(f"http://{first.http}/metrics", timeout=5) as r:
        assert "fthsdp_lighthouse_leader 1.0" in r.read().decode()


def test_leader_that_loses_etcd_refuses_changes_steps_down_and_leads_again_when_it_is_back(
        start_server: Callable[..., ServerThread], channel_to: Callable[[ServerThread], grpc.Channel],
        tmp_path: pathlib.Path) -> None:
    from fthsdp.testing.etcd import EtcdCluster

    etcd = EtcdCluster(tmp_path).start()  # its own etcd: this test stops it
    try:
        s = start_server(HA_POLICY, store=open_store(etcd.url("p")), election_ttl_s=TTL)
        assert s.lh.leading
        stub = pb_grpc.LighthouseStub(channel_to(s))
        register(stub, "a", incarnation="a1")
        watch = stub.Watch(pb.WatchRequest(job_id=JOB), timeout=60)
        assert next(watch).number == 1
        before = s.state()
        etcd.stop()
        with pytest.raises(grpc.RpcError) as info:
            register(stub, "a", incarnation="a2")  # a restart: a new epoch that cannot be stored
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert "store unavailable" in info.value.details() or "does not lead" in info.value.details()  # type: ignore[attr-defined]
        assert s.state() == before
        # Without etcd it cannot know it still leads: once its lease must have expired, it stops serving.
        wait_until(lambda: not s.lh.leading, timeout=3 * TTL + 10, what="the leader stepping down")
        assert http_status(s.http)["leader"] is False
        with pytest.raises(grpc.RpcError) as info:
            next(watch)  # its watch streams end with the same refusal, so clients look for the leader
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert "does not lead" in info.value.details()  # type: ignore[attr-defined]
        # etcd comes back with its data: the lighthouse is elected again and numbers carry on from the store.
        etcd.restart()
        wait_until(lambda: s.lh.leading, timeout=3 * TTL + 15, what="leading again once etcd is back")
        assert s.number() == 1
        assert register(stub, "a", incarnation="a3").epoch.number == 2
    finally:
        etcd.stop()


def test_failover_client_follows_members_survive_numbers_go_on(
        ha_pair: tuple[ServerThread, ServerThread]) -> None:
    first, second = ha_pair
    # The client is given the follower first: the refusal names the leader and it goes there at once.
    addrs = f"{second.addr},{first.addr}"
    epochs: list[int] = []
    a = LighthouseClient(addrs, JOB, "a", on_epoch=lambda e: epochs.append(e.number))
    b = LighthouseClient(addrs, JOB, "b")
    try:
        assert a.start(deadline_s=10) is not None
        assert a.aio.address == first.addr
        b.start(deadline_s=10)
        b.ready("joining")
        b.ready("active")
        wait_until(lambda: b.epoch is not None and b.epoch.number == 3 and a.epoch is not None
                   and a.epoch.number == 3, timeout=10, what="epochs 1..3 on both clients")

        first.stop()  # a graceful stop gives the lease back: the follower takes over at once
        wait_until(lambda: second.lh.leading, timeout=3 * TTL + 5, what="the follower taking over")
        assert second.number() == 3 and set(second.state().members) == {"a", "b"}
        # Both members find the new leader on their own and keep heartbeating: nobody is declared dead.
        wait_until(lambda: a.aio.address == second.addr and b.aio.address == second.addr, timeout=15,
                   what="clients following the new leader")
        beats = a.aio.heartbeats
        wait_until(lambda: a.aio.heartbeats > beats + 3, timeout=10, what="heartbeats to the new leader")
        assert set(second.state().members) == {"a", "b"} and second.number() == 3
        # A membership change after the failover gets the next number: never reused, never back.
        assert b.leave("done") == 4
        wait_until(lambda: a.epoch is not None and a.epoch.number == 4, timeout=10,
                   what="the new leader's epoch pushed to a")
        assert epochs == [1, 2, 3, 4]  # a saw each epoch once, in order, across the failover
    finally:
        a.close()
        b.close()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            stop_process(p, timeout=10)


def test_sigkilled_leader_is_replaced_and_numbers_never_go_back(
        tmp_path: pathlib.Path, etcd_server: Any, procs: list[subprocess.Popen[bytes]]) -> None:
    url = etcd_server.url()
    # b below registers by hand and never heartbeats: a long timeout keeps deaths out of the numbering here
    # (members surviving a failover on a short timeout is the in-process test's business). No knock: the lease
    # has to expire (the knock's takeover is the next test's).
    args = ["--store", url, "--election-ttl", str(TTL), "--heartbeat-timeout", "30", "--no-rendezvous",
            "--election-probe", "0"]

    def launch(name: str) -> tuple[subprocess.Popen[bytes], str, str]:
        d = tmp_path / name
        d.mkdir()
        proc, grpc_addr, http_addr = start_lighthouse_process(args, d)
        procs.append(proc)
        return proc, grpc_addr, http_addr

    p1, g1, h1 = launch("lh1")
    wait_until(lambda: http_status(h1)["leader"], timeout=10, what="the first lighthouse leading")
    p2, g2, h2 = launch("lh2")
    assert http_status(h2)["leader"] is False and http_status(h2)["leader_address"] == g1

    client = LighthouseClient(f"{g2},{g1}", JOB, "a")
    try:
        r = client.start(deadline_s=10)
        assert r is not None and r.epoch.number == 1
        with grpc.insecure_channel(g1) as ch:
            stub = pb_grpc.LighthouseStub(ch)
            for i in range(2):  # b joins, turns active, restarts...: epochs 2 and up
                register(stub, "b", incarnation=f"b{i}")
                for role in (pb.ROLE_JOINING, pb.ROLE_ACTIVE):
                    stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation=f"b{i}", role=role),
                               timeout=5)
        before = http_status(h1)["epoch"]
        assert before >= 4

        p1.send_signal(signal.SIGKILL)  # no goodbye: the lease has to expire
        p1.wait(timeout=10)
        wait_until(lambda: http_status(h2)["leader"], timeout=3 * TTL + 10, what="lh2 taking over after SIGKILL")
        st = http_status(h2)
        assert st["epoch"] == before and st["address"] == g2
        # The client finds lh2 on its own; the next epoch is numbered after the old ones.
        beats = client.aio.heartbeats
        wait_until(lambda: client.aio.address == g2 and client.aio.heartbeats > beats, timeout=15,
                   what="the client following lh2")
        with grpc.insecure_channel(g2) as ch:
            stub = pb_grpc.LighthouseStub(ch)
            register(stub, "c", incarnation="c0")
            after = stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="c", incarnation="c0",
                                               role=pb.ROLE_JOINING), timeout=5).epoch
        assert after == before + 1
        wait_until(lambda: client.epoch is not None and client.epoch.number == after, timeout=10,
                   what="lh2's epoch pushed to the client")
        assert {x["replica_id"] for x in http_status(h2)["members"]} == {"a", "b", "c"}

        # The killed one comes back as a follower and names lh2; numbers stay where they are.
        p3, g3, h3 = launch("lh3")
        st3 = http_status(h3)
        assert st3["leader"] is False and st3["leader_address"] == g2 and st3["epoch"] == after
        # The whole history, as stored, is strictly increasing.
        hist = [e["epoch"] for e in http_status(h2)["history"]]
        assert hist == sorted(set(hist)) and hist[-1] == after
    finally:
        client.close()


def test_a_follower_takes_over_from_a_sigkilled_leader_on_its_refused_port_long_before_the_lease(
        tmp_path: pathlib.Path, etcd_server: Any) -> None:
    """The default: the follower knocks on the leader's port; refused twice by a port it reached before, it
    deposes the leader and leads. With a 30 s lease, leading sooner than that is only possible that way; the
    members follow, and a replica that joins at the kill gets exactly the next epoch, at every member, from the
    new leader (``fthsdp bench failover`` measures how soon: its ``knock`` arm, run here)."""
    from fthsdp.bench.failover import run_once

    ttl = 30
    clients: list[LighthouseClient] = []
    try:
        run = run_once(etcd_server, tmp_path, "knock", 2, ttl, 0.25, 3.0, clients)
    finally:
        for c in clients:
            c.close()
    follower_log = (tmp_path / "follower" / "lighthouse.log").read_text()
    assert "refuses connections (its process is gone)" in follower_log
    assert run.lead_s < ttl  # before the killed leader's lease could have expired: it was deposed
    assert run.lead_s <= run.reconnect_s and run.lead_s <= run.epoch_s
    assert run.epoch_after == run.epoch_before + 1


def test_no_lighthouse_answering_keeps_the_epoch_and_a_restart_continues_numbering(
        tmp_path: pathlib.Path, etcd_server: Any, procs: list[subprocess.Popen[bytes]]) -> None:
    url = etcd_server.url()
    args = ["--store", url, "--election-ttl", str(TTL), "--heartbeat-timeout", "3", "--no-rendezvous"]
    (tmp_path / "one").mkdir()
    p1, g1, h1 = start_lighthouse_process(args, tmp_path / "one")
    procs.append(p1)
    wait_until(lambda: http_status(h1)["leader"], timeout=10, what="leading")
    client = LighthouseClient(g1, JOB, "a")
    try:
        r = client.start(deadline_s=10)
        assert r is not None and r.epoch.number == 1
        p1.send_signal(signal.SIGKILL)
        p1.wait(timeout=10)
        # Nobody answers: the replica keeps its epoch (it trains on); calls fail fast with a typed error.
        from lighthouse.errors import LighthouseUnavailable
        with pytest.raises(LighthouseUnavailable):
            client.status()
        assert client.epoch is not None and client.epoch.number == 1
        # A lighthouse restarted on the same etcd (any port) leads after the old lease expires, with the
        # stored numbers: the replica's next change is numbered after them.
        (tmp_path / "two").mkdir()
        p2, g2, h2 = start_lighthouse_process(args, tmp_path / "two")
        procs.append(p2)
        wait_until(lambda: http_status(h2)["leader"], timeout=3 * TTL + 10, what="the restarted lighthouse leading")
        assert http_status(h2)["epoch"] == 1
        with grpc.insecure_channel(g2) as ch:
            stub = pb_grpc.LighthouseStub(ch)
            again = register(stub, "a")  # a restart of a
        assert again.epoch.number == 2
    finally:
        client.close()


def test_the_election_fails_over_to_another_etcd_member_before_any_error(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    from fthsdp.testing.etcd import EtcdCluster
    from lighthouse.stores.etcd import EtcdStore

    etcd = EtcdCluster(tmp_path, members=3).start()  # its own: this test kills a member
    stores: list[EtcdStore] = []
    try:
        url = etcd.url("failover")
        changes: dict[str, list[tuple[bool, str]]] = {"lead": [], "follow": []}
        elections = {}
        for name, address in (("lead", "10.0.0.1:1"), ("follow", "10.0.0.2:1")):
            # pyetcd starts on a member picked at random: open the follower's until it uses the leader's one.
            for _ in range(50):
                store = EtcdStore(url)
                if not stores or store.client.endpoint_in_use.netloc == stores[0].client.endpoint_in_use.netloc:
                    break
                store.close()
            stores.append(store)
            elections[name] = store.election(address, "", lambda up, at, n=name: changes[n].append((up, at)),
                                             ttl_s=TTL)
            elections[name].first_round()
        assert elections["lead"].leading and elections["follow"].leader == "10.0.0.1:1"
        # Both talk to the same etcd member: kill it.
        in_use = {s.client.endpoint_in_use.netloc for s in stores}
        assert len(in_use) == 1
        victim = [f"127.0.0.1:{c}" for c, _ in etcd.ports].index(in_use.pop())
        etcd.kill(victim)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fthsdp.lighthouse.election"):
            for _ in range(3):  # a renewal for the leader, a campaign for the follower, each time
                for e in elections.values():
                    e.first_round()
        assert not [r for r in caplog.records if "unreachable" in r.getMessage()], caplog.text
        assert elections["lead"].leading and elections["follow"].leader == "10.0.0.1:1"
        # Neither ever lost sight of the leader: no change after the first round.
        assert changes == {"lead": [(True, "10.0.0.1:1")], "follow": [(False, "10.0.0.1:1")]}
        assert all(s.client.endpoint_in_use.netloc != f"127.0.0.1:{etcd.ports[victim][0]}" for s in stores)
    finally:
        for e in elections.values():
            e.stop()
        for s in stores:
            s.close()
        etcd.stop()
