"""Heartbeat deadlines in a heap (``lighthouse.liveness``) and the tick that checks only what is due
(``Tick.due``): the same deaths as a full scan, at the cost of the members due."""

from __future__ import annotations

import asyncio
import socket

from lighthouse import membership as m
from lighthouse.events import DeathCause, Died
from lighthouse.liveness import Deadlines
from lighthouse.server import probe

POLICY = m.Policy(min_replicas=1, expected_replicas=3, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0,
                  confirm_age_s=1.0)


def test_only_the_silent_are_due_and_the_heard_are_pushed_back() -> None:
    seen = {"a": 0.0, "b": 0.0, "c": 0.0}
    d = Deadlines(5.0)
    d.add(seen, seen)
    assert d.due(4.9, seen) == frozenset()
    seen["a"] = 4.0  # heard from: its deadline moves to 9
    assert d.due(5.0, seen) == {"b", "c"}
    assert d.due(5.1, seen) == {"b", "c"}  # due at every tick until the decision drops them
    del seen["b"], seen["c"]  # dropped: forgotten
    assert d.due(8.9, seen) == frozenset() and len(d) == 1
    assert d.due(9.0, seen) == {"a"}


def _three() -> m.State:
    s = m.State()
    for rid in "abc":
        s = m.decide(s, m.Register(rid, f"{rid}1", 1, m.Endpoints(), 0.0), POLICY).state
    assert s.epoch is not None
    return s


def test_a_tick_on_the_due_decides_as_a_full_scan() -> None:
    s = _three()
    seen = {"a": 10.0, "b": 3.0, "c": 10.0}
    full = m.decide(s, m.Tick(now=10.0, last_seen=seen), POLICY)
    heap = m.decide(s, m.Tick(now=10.0, last_seen=seen, due=frozenset({"b"})), POLICY)
    assert full.events == heap.events and [e.replica_id for e in full.events if isinstance(e, Died)] == ["b"]
    # Nothing due, nothing suspected: nothing happens, without looking at anyone.
    assert m.decide(s, m.Tick(now=10.0, last_seen=seen, due=frozenset()), POLICY).state is s


def test_a_suspect_whose_connection_closes_is_confirmed_at_once() -> None:
    s = _three()
    seen = {"a": 1.0, "b": 1.0, "c": 1.0}
    out = m.decide(s, m.Report("a", "a1", "b", s.epoch.number, "lane timeout", 1.1, seen), POLICY)
    assert not out.confirmed and "b" in out.state.suspicions  # heard from 0.1 s ago: not confirmed yet
    s = out.state
    assert m.decide(s, m.Tick(now=1.2, last_seen=seen, due=frozenset()), POLICY).state is s
    died = m.decide(s, m.Tick(now=1.2, last_seen=seen, due=frozenset(), disconnected=frozenset({"b"})), POLICY)
    assert [(e.replica_id, e.cause) for e in died.events if isinstance(e, Died)] == [("b", DeathCause.DISCONNECTED)]
    assert died.state.epoch is not None and died.state.epoch.member("b") is None
    # A closed connection of a member nobody reported is no death (silence still decides that).
    assert m.decide(_three(), m.Tick(now=1.2, last_seen=seen, due=frozenset(),
                                     disconnected=frozenset({"c"})), POLICY).events == ()


def test_a_bootstrap_counts_on_instead_of_recounting() -> None:
    policy = m.Policy(expected_replicas=500, heartbeat_timeout_s=100.0, heartbeat_interval_s=1.0)
    s = m.State()
    for i in range(499):
        s = m.decide(s, m.Register(f"r{i:03d}", "1", 1, m.Endpoints(), float(i)), policy).state
        known = s.known_in_epoch_count()
        assert known is None or known == sum(1 for x in s.members.values() if x.in_epoch)
    assert s.epoch is None and s.known_in_epoch_count() == 499  # carried along, not counted 499 times
    s = m.decide(s, m.Register("r499", "1", 1, m.Endpoints(), 499.0), policy).state
    assert s.epoch is not None and len(s.epoch.members) == 500


def test_a_member_whose_endpoint_refused_is_dead_at_once_but_only_its_own_incarnation() -> None:
    s = _three()
    seen = {"a": 1.0, "b": 1.0, "c": 1.0}  # heard from 0.1 s ago, nobody reported it
    out = m.decide(s, m.Tick(now=1.1, last_seen=seen, due=frozenset(), gone={"b": "b1"}), POLICY)
    assert [(e.replica_id, e.cause) for e in out.events if isinstance(e, Died)] == [("b", DeathCause.GONE)]
    assert out.state.epoch is not None and out.state.epoch.member("b") is None
    assert "refused a connection" in out.state.epoch.reason
    # Another incarnation's probe (b restarted meanwhile), or an id that is no member: nothing happens.
    assert m.decide(s, m.Tick(now=1.1, last_seen=seen, due=frozenset(), gone={"b": "b0"}), POLICY).state is s
    assert m.decide(s, m.Tick(now=1.1, last_seen=seen, due=frozenset(), gone={"zz": "z1"}), POLICY).state is s


def test_the_probe_says_refused_only_when_the_host_refuses() -> None:
    assert probe.split("127.0.0.1:80") == ("127.0.0.1", 80) and probe.split("[::1]:9") == ("::1", 9)
    assert probe.split("") is None and probe.split("host") is None and probe.split("h:0") is None
    with socket.socket() as closed, socket.socket() as open_:
        closed.bind(("127.0.0.1", 0))
        open_.bind(("127.0.0.1", 0))
        open_.listen()
        assert asyncio.run(probe.refused(f"127.0.0.1:{closed.getsockname()[1]}", 2.0))
        assert not asyncio.run(probe.refused(f"127.0.0.1:{open_.getsockname()[1]}", 2.0))
    assert not asyncio.run(probe.refused("not an address", 2.0))
