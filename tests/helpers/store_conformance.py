"""One conformance suite for the data plane's rendezvous stores (``torch.distributed.Store`` semantics): the
lighthouse's (``ftar.store.LighthouseStore``) and a member's lane store (``ftar.lane_store.MemberStore``) both pass
it, and Gloo builds a group on either."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

from ftar.group import configure_with_store
from ftar.store import StoreTimeout

MakeStore = Callable[[float], Any]
"""A new client of the same namespace, whose blocking calls wait up to the given seconds."""


def check_semantics(make: MakeStore) -> None:
    """set/get/add/compare_set/check/wait/delete_key/num_keys as torch's stores have them."""
    s = make(0.3)
    s.set("a", b"1")
    s.set("b", "text")
    assert s.get("a") == b"1" and s.get("b") == b"text"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5 and s.get("n") == b"5"
    assert s.compare_set("c", b"", b"x") == b"x"
    assert s.compare_set("c", b"wrong", b"y") == b"x"
    assert s.compare_set("c", b"x", b"z") == b"z"
    assert s.compare_set("absent", b"expected", b"v") == b"expected" and not s.check(["absent"])
    assert s.check(["a", "b"]) and not s.check(["a", "nope"])
    s.wait(["a", "b"])
    with pytest.raises(StoreTimeout):
        s.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(StoreTimeout):
        s.get("never")
    keys = s.num_keys()
    assert s.delete_key("a") and not s.delete_key("a") and s.num_keys() == keys - 1
    twin = s.clone()
    twin.set("from-twin", b"t")
    assert s.get("from-twin") == b"t"


def check_blocking_get(make: MakeStore, waiters: int = 16) -> None:
    """Blocking gets wait on the store until the key is set, then every waiter gets it."""
    got: list[bytes] = []
    lock = threading.Lock()

    def get() -> None:
        value = make(30.0).get("late")
        with lock:
            got.append(value)

    threads = [threading.Thread(target=get, daemon=True) for _ in range(waiters)]
    for t in threads:
        t.start()
    make(1.0).set("late", b"here")
    for t in threads:
        t.join(30)
    assert got == [b"here"] * waiters


def check_gloo_group(make: MakeStore, world: int = 3) -> None:
    """``world`` members build a Gloo group on the store and all-reduce exactly."""
    sums: dict[int, list[float]] = {}

    def member(rank: int) -> None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        base = make(10.0)  # held here: the C++ group holds the store but does not keep its Python object alive
        configure_with_store(pg, dist.PrefixStore("lane0/pg", base), f"r{rank}", rank, world)
        t = torch.full((4,), float(rank + 1))
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        sums[rank] = t.tolist()
        pg.abort(errored=False)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == {r: [float(sum(range(1, world + 1)))] * 4 for r in range(world)}
