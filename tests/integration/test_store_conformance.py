"""Store conformance: every ``lighthouse.stores.base.Store`` implementation must pass these (docs/design.md §4: the
same tests run against the in-memory and the etcd store, the latter on a real etcd started by the tests). Add an
implementation to ``STORES``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lighthouse import membership as m
from lighthouse.errors import EpochFenced
from lighthouse.stores.base import Store
from lighthouse.stores.etcd_tls import EtcdTLS
from lighthouse.stores.factory import open_store
from lighthouse.stores.memory import InMemoryStore
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, ServerThread, heartbeat, register, status, wait_until

# The kinds of store under test. The etcd ones run on the session's real etcd (a fresh key prefix per test), in
# plaintext and over TLS with a client certificate (an etcd requiring them, as deploy/k8s runs it); they fail,
# never skip, when etcd is not installed.
STORES: list[str] = ["memory", "memory-url", "etcd", "etcd-tls"]


@pytest.fixture(params=STORES)
def new_store(request: pytest.FixtureRequest) -> Iterator[Callable[[], Store]]:
    """Factory of stores of the kind under test, all on the same data (two lighthouses on one etcd prefix, or
    one in-memory store handed out again); every store made is closed at teardown."""
    kind = str(request.param)
    made: list[Store] = []
    url, tls = "", None
    if kind == "etcd":
        url = request.getfixturevalue("etcd_server").url()
    elif kind == "etcd-tls":
        server, c = request.getfixturevalue("etcd_tls_server")
        url, tls = server.url(), EtcdTLS(c.ca, c.client_cert, c.client_key)
    shared: Store = InMemoryStore() if kind == "memory" else open_store("memory://")

    def make() -> Store:
        s = open_store(url, tls) if url else shared
        made.append(s)
        return s

    yield make
    for s in {id(x): x for x in made}.values():
        s.close()


@pytest.fixture
def store(new_store: Callable[[], Store]) -> Store:
    return new_store()


def doc(number: int, **extra: Any) -> dict[str, Any]:
    return {"last_number": number, "epoch": {"number": number, "members": [], "reason": "ünïcode ✓",
                                             "created_at": 1.5}, "history": [], **extra}


def test_load_of_missing_job_is_none(store: Store) -> None:
    assert store.load("nothing-here") is None


def test_save_then_load_round_trips(store: Store) -> None:
    d = doc(1, nested={"a": [1, 2.5, None, True, "x"]})
    store.save(JOB, 0, d)
    assert store.load(JOB) == d
    d2 = doc(2)
    store.save(JOB, 1, d2)
    assert store.load(JOB) == d2


def test_loaded_document_is_a_copy(store: Store) -> None:
    d = doc(1)
    store.save(JOB, 0, d)
    d["history"].append("mutated after save")
    loaded = store.load(JOB)
    assert loaded is not None and loaded["history"] == []
    loaded["last_number"] = 99
    assert store.load(JOB)["last_number"] == 1  # type: ignore[index]


@pytest.mark.parametrize("expected", [1, 2, 7])
def test_save_with_wrong_expected_number_is_fenced_and_writes_nothing(store: Store, expected: int) -> None:
    with pytest.raises(EpochFenced):
        store.save(JOB, expected, doc(expected + 1))  # nothing stored yet: the stored number is 0
    assert store.load(JOB) is None
    store.save(JOB, 0, doc(3))
    for wrong in (0, 2, 4):
        with pytest.raises(EpochFenced):
            store.save(JOB, wrong, doc(10))
    assert store.load(JOB) == doc(3)


def test_document_whose_number_goes_back_is_refused(store: Store) -> None:
    store.save(JOB, 0, doc(5))
    with pytest.raises(EpochFenced):
        store.save(JOB, 5, doc(4))
    assert store.load(JOB) == doc(5)
    with pytest.raises(EpochFenced):
        store.save("fresh", 3, doc(2))
    assert store.load("fresh") is None


def test_jobs_are_independent(store: Store) -> None:
    store.save("job-a", 0, doc(1, who="a"))
    assert store.load("job-b") is None
    store.save("job-b", 0, doc(4, who="b"))
    store.save("job-a", 1, doc(2, who="a"))
    with pytest.raises(EpochFenced):
        store.save("job-b", 2, doc(3))  # job-a's number is not job-b's
    assert store.load("job-a") == doc(2, who="a")
    assert store.load("job-b") == doc(4, who="b")


def test_concurrent_writers_with_the_same_expected_number_exactly_one_wins(store: Store) -> None:
    writers = 8
    store.save(JOB, 0, doc(1))
    for round_ in range(1, 11):
        barrier = threading.Barrier(writers)
        results: list[tuple[int, str]] = []
        lock = threading.Lock()

        def write(i: int, barrier: threading.Barrier = barrier, round_: int = round_,
                  results: list[tuple[int, str]] = results, lock: threading.Lock = lock) -> None:
            barrier.wait(timeout=10)
            try:
                store.save(JOB, round_, doc(round_ + 1, writer=i))
                outcome = "won"
            except EpochFenced:
                outcome = "fenced"
            with lock:
                results.append((i, outcome))

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
        winners = [i for i, outcome in results if outcome == "won"]
        assert len(results) == writers and len(winners) == 1, results
        assert store.load(JOB) == doc(round_ + 1, writer=winners[0])


# --- the lighthouse on a store ------------------------------------------------------------------------------------

STEADY = m.Policy(min_replicas=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0, confirm_age_s=10.0)


@pytest.fixture
def stub_for(channel_to: Callable[[ServerThread], grpc.Channel]) -> Callable[[ServerThread], pb_grpc.LighthouseStub]:
    return lambda s: pb_grpc.LighthouseStub(channel_to(s))


def _form_epochs(stub: pb_grpc.LighthouseStub) -> dict[str, str]:
    """Epochs 1..3: a alone; b ready as joiner; b active."""
    incs = {"a": register(stub, "a").incarnation}
    b = register(stub, "b")
    incs["b"] = b.incarnation
    for role in (pb.ROLE_JOINING, pb.ROLE_ACTIVE):
        stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation=b.incarnation, role=role), timeout=5)
    assert status(stub).epoch.number == 3
    return incs


def test_restarted_lighthouse_on_the_same_store_continues_numbering(
        start_server: Callable[..., ServerThread], stub_for: Callable[[ServerThread], pb_grpc.LighthouseStub],
        new_store: Callable[[], Store]) -> None:
    store = new_store()
    first = start_server(STEADY, store=new_store())
    incs = _form_epochs(stub_for(first))
    first.stop()
    saved = store.load(JOB)
    assert saved is not None and saved["last_number"] == 3

    second = start_server(STEADY, store=new_store())
    stub = stub_for(second)
    st = status(stub)
    assert st.epoch.number == 3 and [x.replica_id for x in st.epoch.members] == ["a", "b"]
    assert [h.epoch for h in st.history] == [1, 2, 3]
    # The members carried over keep heartbeating with their incarnations: no re-registration needed.
    assert heartbeat(stub, "a", incs["a"]).epoch == 3
    # A re-registration (a restart) forms a new epoch, numbered after the old ones.
    again = register(stub, "b")
    assert again.epoch.number == 4 and [x.replica_id for x in again.epoch.members] == ["a"]
    assert store.load(JOB)["last_number"] == 4  # type: ignore[index]
    second.stop()

    third = start_server(STEADY, store=new_store())
    r = register(stub_for(third), "a")  # a restart of a, whose restored incarnation differs
    assert r.epoch.number > 4
    numbers = [h.epoch for h in status(stub_for(third)).history]
    assert numbers == sorted(set(numbers)) and numbers[-1] == r.epoch.number


def test_fenced_store_write_changes_nothing(start_server: Callable[..., ServerThread],
                                           stub_for: Callable[[ServerThread], pb_grpc.LighthouseStub],
                                           new_store: Callable[[], Store]) -> None:
    store = new_store()
    s = start_server(STEADY, store=new_store())
    stub = stub_for(s)
    register(stub, "a")
    assert store.load(JOB)["last_number"] == 1  # type: ignore[index]
    # Another lighthouse advanced the job behind this one's back.
    store.save(JOB, 1, doc(5))
    with pytest.raises(grpc.RpcError) as info:
        register(stub, "a")  # a restart would form epoch 2
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "fenced" in info.value.details()  # type: ignore[attr-defined]
    assert status(stub).epoch.number == 1 and s.state().last_number == 1
    assert store.load(JOB) == doc(5)


def test_restored_members_that_never_come_back_die(start_server: Callable[..., ServerThread],
                                                   stub_for: Callable[[ServerThread], pb_grpc.LighthouseStub],
                                                   new_store: Callable[[], Store]) -> None:
    first = start_server(STEADY, store=new_store())
    _form_epochs(stub_for(first))
    first.stop()
    fast = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, confirm_age_s=0.2)
    second = start_server(fast, store=new_store())
    assert second.number() == 3
    # Nobody heartbeats: both restored members die; the guard (no one left) keeps epoch 3 as the last one.
    wait_until(lambda: not second.state().members, timeout=5, what="restored members declared dead")
    assert second.number() == 3
    r = register(stub_for(second), "c")
    assert r.role == pb.ROLE_ACTIVE and r.epoch.number == 4


# --- the etcd store's own guarantees -------------------------------------------------------------------------------


def test_etcd_writer_that_lost_leadership_is_fenced_even_with_the_current_number(etcd_server: Any) -> None:
    from lighthouse.stores.etcd import EtcdStore

    url = etcd_server.url()
    old, new = EtcdStore(url), EtcdStore(url)
    try:
        leader_key = old.key("leader")
        new.client.put(leader_key, b"old")
        old.set_guard(leader_key, b"old")
        old.save(JOB, 0, doc(1))
        new.client.put(leader_key, b"new")  # the old leader's lease expired; another took over
        new.set_guard(leader_key, b"new")
        with pytest.raises(EpochFenced, match="no longer leads"):
            old.save(JOB, 1, doc(2))  # its number is still the stored one: only the leadership fence stops it
        assert new.load(JOB) == doc(1)
        new.save(JOB, 1, doc(2))
        assert old.load(JOB) == doc(2)
    finally:
        old.close()
        new.close()


def test_etcd_store_moves_on_from_a_dead_endpoint(etcd_server: Any) -> None:
    from fthsdp.testing.ports import free_port

    url = etcd_server.url()
    dead = f"127.0.0.1:{free_port()}"
    for i in range(4):  # pyetcd starts on a random endpoint: both orders get exercised
        s = open_store(url.replace("etcd://", f"etcd://{dead},", 1))
        try:
            assert (s.load(JOB) or {}).get("last_number", 0) == i
            s.save(JOB, i, doc(i + 1))
        finally:
            s.close()


def test_etcd_save_whose_answer_was_lost_is_not_reported_as_fenced(etcd_server: Any) -> None:
    """The transaction committed but its answer was lost (the connection broke): the retry on the next endpoint
    finds this very document stored and reports success, not a spurious fence."""
    from pyetcd.exceptions import ConnectionFailedError

    from lighthouse.stores.etcd import EtcdStore

    url = etcd_server.url()
    # Two names of the same live etcd: two endpoints to pyetcd.
    s = EtcdStore(url.replace("etcd://", f"etcd://localhost:{etcd_server.client_port},", 1))
    try:
        s.save(JOB, 0, doc(1))
        real = s.client.transaction
        calls = {"n": 0}

        def commit_then_lose_the_answer(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            out = real(*args, **kwargs)
            if calls["n"] == 1:
                raise ConnectionFailedError()
            return out

        s.client.transaction = commit_then_lose_the_answer  # type: ignore[method-assign]
        s.save(JOB, 1, doc(2))
        assert calls["n"] == 2 and s.load(JOB) == doc(2)
        # A genuine fence is still a fence, with or without a lost answer.
        calls["n"] = 0
        with pytest.raises(EpochFenced):
            s.save(JOB, 1, doc(3))
        assert s.load(JOB) == doc(2)
    finally:
        s.close()
