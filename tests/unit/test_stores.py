"""The stores' own guarantees that need no store process: URL parsing and the factory, and a typed error within
the deadline when etcd does not answer. (The conformance suite, run against every store, is
tests/integration/test_store_conformance.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from lighthouse.stores.factory import open_store
from tests.helpers.lighthouse import JOB


def doc(number: int, **extra: Any) -> dict[str, Any]:
    return {"last_number": number, "epoch": {"number": number, "members": [], "reason": "ünïcode ✓",
                                             "created_at": 1.5}, "history": [], **extra}


def test_etcd_url_parsing() -> None:
    from lighthouse.stores.etcd_client import DEFAULT_PREFIX, EtcdTarget

    t = EtcdTarget.parse("etcd://127.0.0.1:2379,[::1]:2380/jobs/a/")
    assert t.endpoints == (("127.0.0.1", 2379), ("::1", 2380)) and t.prefix == "/jobs/a"
    assert EtcdTarget.parse("etcd://h:1").prefix == DEFAULT_PREFIX
    for bad in ("etcd://", "etcd://host", "etcd://host:port", "http://h:1", "etcd://h:1,:2"):
        with pytest.raises(ValueError):
            EtcdTarget.parse(bad)
    with pytest.raises(ValueError, match="unsupported store"):
        open_store("redis://h:1")


def test_etcd_unreachable_is_a_typed_error_within_the_deadline() -> None:
    import time

    from fthsdp.testing.ports import free_port
    from lighthouse.errors import StoreUnavailable
    from lighthouse.stores.etcd import EtcdStore

    s = EtcdStore(f"etcd://127.0.0.1:{free_port()}/x", timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            s.load(JOB)
        with pytest.raises(StoreUnavailable):
            s.save(JOB, 0, doc(1))
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
