"""The data-plane rendezvous table's pure rules (``lighthouse.rendezvous``): namespaces per job and epoch, which
epochs are admitted, key validation and size limits. A refused call raises a clear error and changes nothing."""

from __future__ import annotations

import pytest

from lighthouse.errors import ValidationError
from lighthouse.rendezvous import (
    Limits,
    OutOfRange,
    RendezvousRefused,
    RendezvousTable,
    admissible,
    check_keys,
    check_wait,
    namespace_of,
    parse_namespace,
)

SMALL = Limits(key_chars=16, value_bytes=8, keys_per_call=3, keys_per_namespace=3, bytes_per_namespace=40, wait_s=5)


def test_namespace_is_job_and_epoch() -> None:
    assert namespace_of("job", 7) == "job/epoch7"
    assert parse_namespace("job", "job/epoch7") == 7
    for bad in ("other/epoch7", "job/epoch0", "job/epoch-1", "job/epoch7/x", "job/epochs", "", "job", "../epoch1"):
        with pytest.raises(RendezvousRefused):
            parse_namespace("job", bad)
    assert issubclass(RendezvousRefused, ValidationError)  # answered INVALID_ARGUMENT by the service


def test_only_the_current_plane_and_a_few_recent_epochs_are_admitted() -> None:
    assert admissible(10, 10, 10)
    assert not admissible(11, 10, 10)  # the future: nobody can have been told about it
    assert not admissible(0, 10, 10)
    assert admissible(6, 10, 10, keep=4) and not admissible(5, 10, 10, keep=4)
    assert admissible(2, 10, 2, keep=4)  # the data plane the current epoch keeps (roles changed only)


def test_keys_are_checked() -> None:
    assert check_keys(["a", "lane0/pg/0"], SMALL) == ["a", "lane0/pg/0"]
    for keys in ([], ["a"] * 4, [""], ["x" * 17], ["a\nb"], ["a\x00"]):
        with pytest.raises(RendezvousRefused):
            check_keys(keys, SMALL)
    with pytest.raises(RendezvousRefused, match="exactly one"):
        check_keys(["a", "b"], SMALL, one=True)


def test_wait_is_bounded() -> None:
    assert check_wait(1.5, SMALL) == 1.5
    assert check_wait(1e9, SMALL) == 5
    for bad in (-1.0, float("nan")):
        with pytest.raises(RendezvousRefused):
            check_wait(bad, SMALL)


def test_store_semantics_follow_torch() -> None:
    t = RendezvousTable("job", SMALL)
    _, ns = t.namespace("job/epoch1", 1, 1)
    t.set(ns, "k", b"v")
    assert ns.values == {"k": b"v"} and ns.has(["k"]) and not ns.has(["k", "z"])
    assert t.add(ns, "c", 2) == 2 and t.add(ns, "c", -5) == -3
    assert t.compare_set(ns, "n", b"", b"new") == b"new"  # absent, expected empty: set
    assert t.compare_set(ns, "n", b"other", b"x") == b"new"  # mismatch: the current value, unchanged
    assert t.compare_set(ns, "n", b"new", b"2") == b"2"
    with pytest.raises(RendezvousRefused, match="already holds 3 keys"):
        t.compare_set(ns, "absent", b"", b"1")
    assert t.delete(ns, "n") and not t.delete(ns, "n")
    assert t.compare_set(ns, "absent", b"exp", b"x") == b"exp" and "absent" not in ns.values


@pytest.mark.parametrize("call", [
    lambda t, ns: t.set(ns, "k", b"123456789"),  # value over 8 bytes
    lambda t, ns: t.set(ns, "", b"1"),
    lambda t, ns: t.set(ns, "k" * 17, b"1"),
    lambda t, ns: t.add(ns, "v", 1),  # not an integer
    lambda t, ns: t.set(ns, "new", b"1"),  # a third key would pass, a fourth not: see below
])
def test_refused_calls_change_nothing(call: object) -> None:
    t = RendezvousTable("job", SMALL)
    _, ns = t.namespace("job/epoch1", 1, 1)
    t.set(ns, "v", b"text")
    t.set(ns, "w", b"12345678")
    t.set(ns, "x", b"1")
    before = (dict(ns.values), ns.size)
    with pytest.raises(RendezvousRefused):
        call(t, ns)  # type: ignore[operator]
    assert (ns.values, ns.size) == before


def test_namespace_bytes_are_bounded() -> None:
    t = RendezvousTable("job", Limits(value_bytes=100, bytes_per_namespace=50))
    _, ns = t.namespace("job/epoch1", 1, 1)
    t.set(ns, "a", b"x" * 40)
    with pytest.raises(RendezvousRefused, match="exceed 50 bytes"):
        t.set(ns, "b", b"x" * 20)
    t.set(ns, "a", b"y" * 45)  # replacing counts the old value out
    assert ns.size == 46 and ns.values["a"] == b"y" * 45


def test_old_namespaces_are_dropped_and_future_ones_refused() -> None:
    t = RendezvousTable("job")
    _, ns1 = t.namespace("job/epoch1", 1, 1)
    t.set(ns1, "k", b"v")
    with pytest.raises(OutOfRange):
        t.namespace("job/epoch2", 1, 1)
    assert set(t.namespaces) == {1}
    t.namespace("job/epoch20", 20, 20)
    assert set(t.namespaces) == {20}  # epoch 1 is gone with its keys
    with pytest.raises(OutOfRange):
        t.namespace("job/epoch1", 20, 20)
    with pytest.raises(RendezvousRefused, match="another job"):
        t.namespace("other/epoch20", 20, 20)


def test_a_write_wakes_only_the_waiters_of_its_key_and_a_drop_wakes_all() -> None:
    """A lane of N members waits for N keys: each write must wake its key's waiters only (O(N) wake-ups for the
    lane, not N per write), and dropping a namespace must end its waiters at once."""
    import asyncio

    from lighthouse.rendezvous_ops import LiveTable, Req

    async def main() -> None:
        live = LiveTable("job")
        ns = live.namespace(Req(namespace="job/epoch1"), 1, 1)
        waiters = [asyncio.create_task(live.call("Get", Req(keys=[f"k{i}"], timeout_s=30), ns)) for i in range(50)]
        await asyncio.sleep(0)  # let every waiter block
        events = dict(live._waiting[id(ns)])
        assert set(events) == {f"k{i}" for i in range(50)}
        await live.call("Set", Req(keys=["k7"], value=b"v"), ns)
        assert (await asyncio.wait_for(waiters[7], 5)).value == b"v"
        assert not any(w.done() for i, w in enumerate(waiters) if i != 7)
        assert all(live._waiting[id(ns)][k] is e and not e.is_set() for k, e in events.items() if k != "k7")
        live.namespace(Req(namespace="job/epoch9"), 9, 9)  # epoch 1 is dropped with its keys
        results = await asyncio.gather(*(w for i, w in enumerate(waiters) if i != 7))
        assert all(not r.ok for r in results)

    asyncio.run(main())
