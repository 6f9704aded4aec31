"""A follower lighthouse deposes a leader whose process is gone (``lighthouse.stores.election``): its port, reached
before, refuses twice in a row. Nothing less deposes it: a timeout or no route, a leader never reached, one refusal,
or a leader key that changed meanwhile. On a fake etcd (the real one is the integration tests')."""

from __future__ import annotations

from typing import Any

from pyetcd import transactions as etcd_tx
from pyetcd.client import Transactions

from lighthouse.stores.election import STRIKES, EtcdElection, LeaderInfo

KEY = "/fthsdp/job/leader"


class FakeLease:
    def __init__(self, store: FakeEtcd) -> None:
        self.store, self.revoked = store, False

    def revoke(self) -> None:
        self.revoked = True
        self.store.kv = {k: v for k, v in self.store.kv.items() if self.store.leases.get(k) is not self}

    def refresh(self) -> list[Any]:
        return [type("R", (), {"TTL": 0 if self.revoked else 5})()]


class FakeEtcd:
    """The subset of a pyetcd client the election uses: a key-value dict, leases, and transactions comparing a
    key's value or its existence."""

    endpoints = ["127.0.0.1:2379"]
    transactions = Transactions()

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.leases: dict[str, FakeLease] = {}
        self.deletes = 0

    def lease(self, ttl: int) -> FakeLease:
        return FakeLease(self)

    def get(self, key: str) -> tuple[bytes | None, None]:
        return self.kv.get(key), None

    def transaction(self, compare: list[Any], success: list[Any], failure: list[Any]) -> tuple[bool, list[Any]]:
        def holds(c: Any) -> bool:
            if isinstance(c, etcd_tx.Create):
                return (c.key in self.kv) == (c.value != 0)
            assert isinstance(c, etcd_tx.Value)
            return self.kv.get(c.key) == c.value

        ok = all(holds(c) for c in compare)
        out = []
        for op in success if ok else failure:
            if isinstance(op, etcd_tx.Put):
                self.kv[op.key], self.leases[op.key] = op.value, op.lease
            elif isinstance(op, etcd_tx.Delete):
                self.deletes += 1
                self.kv.pop(op.key, None)
            elif isinstance(op, etcd_tx.Get):
                out.append([(self.kv[op.key], None)] if op.key in self.kv else [])
        return ok, out


class Door:
    """The leader's port as the follower's knock finds it (True refused, False answered, None no evidence)."""

    def __init__(self) -> None:
        self.answers: list[bool | None] = []
        self.knocked: list[str] = []

    def __call__(self, address: str) -> bool | None:
        self.knocked.append(address)
        return self.answers.pop(0)


def pair() -> tuple[FakeEtcd, EtcdElection, EtcdElection, Door]:
    etcd, door = FakeEtcd(), Door()
    changes: list[tuple[bool, str]] = []
    leader = EtcdElection(etcd, KEY, lambda k, v: None, "lh-a:1", "", lambda *c: changes.append(c), ttl_s=2)
    follower = EtcdElection(etcd, KEY, lambda k, v: None, "lh-b:1", "", lambda *c: changes.append(c), ttl_s=2,
                            probe_s=0.25, knock=door)
    leader.first_round()
    follower.first_round()
    assert leader.leading and not follower.leading and follower.leader == "lh-a:1"
    return etcd, leader, follower, door


def test_a_leader_reached_before_that_refuses_twice_is_deposed_and_the_follower_takes_over() -> None:
    etcd, leader, follower, door = pair()
    door.answers = [False, True]
    assert not follower.leader_reached
    assert not follower._gone()  # reached: it answers
    assert follower.leader_reached and not leader.leader_reached  # what /status says (leader_reached)
    assert not follower._gone()  # one refusal is not enough (a port being rebound)
    assert STRIKES == 2
    door.answers = [True]
    assert follower._gone()
    assert KEY not in etcd.kv and etcd.deletes == 1
    follower._round()
    assert follower.leading and LeaderInfo.decode(etcd.kv[KEY]) == follower.me
    assert not follower.leader_reached
    assert door.knocked == ["lh-a:1"] * 3
    leader._round()  # had it lived after all: its renewal finds the key is not its own, and it steps down
    assert not leader.leading


def test_no_evidence_never_deposes() -> None:
    """A timeout or no route (None) between refusals starts the count again; a leader never reached is never
    deposed, however often it refuses (an address this follower cannot connect to proves nothing)."""
    etcd, _, follower, door = pair()
    door.answers = [True] * 5
    assert not any(follower._gone() for _ in range(5))  # never reached
    assert not follower.leader_reached
    door.answers = [False, True, None, True, None]
    assert not any(follower._gone() for _ in range(5))
    assert etcd.deletes == 0 and LeaderInfo.decode(etcd.kv[KEY]) is not None
    assert not follower.leading


def test_a_leader_key_that_changed_meanwhile_is_left_alone() -> None:
    """Between the follower's last read and its deposition another lighthouse took over: the transaction compares
    the value the follower read, so the new leader's key stays."""
    etcd, _, follower, door = pair()
    newer = LeaderInfo("lh-c:1", "", "c").encode()
    door.answers = [False, True, True]
    follower._gone()
    follower._gone()
    etcd.kv[KEY] = newer
    assert follower._gone()  # it campaigns, and loses to the holder
    assert etcd.kv[KEY] == newer and etcd.deletes == 0
    follower._round()
    assert not follower.leading and follower.leader == "lh-c:1"


def test_without_a_knock_or_while_leading_nothing_is_knocked_on() -> None:
    etcd, leader, _, door = pair()
    plain = EtcdElection(etcd, KEY, lambda k, v: None, "lh-d:1", "", lambda *c: None, ttl_s=2, probe_s=0.25)
    plain.first_round()
    assert plain.probe_s == 0 and not plain._gone()
    assert not leader._gone() and door.knocked == []
