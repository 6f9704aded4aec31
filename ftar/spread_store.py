"""One lane's rendezvous spread over several members' stores (docs/design.md §5, "Lanes at scale"; which stores:
``lighthouse.lane_hosts.stores``), so that no one store serves every member of a lane of a thousand.

A member reads from its own store (``own``: its index in the epoch modulo the stores) and writes to all of them, so
every key any member sets is found on every store. A member's arrival (``<prefix>/arrived/<index>``) is the
exception: it is written to, and read from, that member's store alone, so each store serves its share of the
arrivals and the blame of a failed rendezvous still finds every member that arrived. Counters and compare-and-set
are applied to every store in order and answer with the first store's result, which is atomic; a member reading
a counter on its own store may see it trail the first's while another member's write is on its way (c10d's connect
sets each of its keys once, from one member, and never reads a counter).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

ARRIVED = "arrived"
"""The lane-store key prefix a member sets (``arrived/<its index in the epoch>``) as it arrives."""
_OWNED = re.compile(rf"(?:^|/){ARRIVED}/(\d+)$")


class SpreadStore(dist.Store):
    """``stores`` (clients of the same namespace on different members' stores, in the lane's order) seen as one by
    the member whose own is ``stores[own]``."""

    def __init__(self, stores: Sequence[Any], own: int) -> None:
        super().__init__()
        if not stores or not 0 <= own < len(stores):
            raise ValueError(f"a spread store needs its own store among {len(stores)}, not {own}")
        self.stores = list(stores)
        self.own = own
        self._clones: list[SpreadStore] = []

    def _of(self, key: str) -> Any:
        """The store ``key`` is read from: its member's for an arrival, else this member's own."""
        m = _OWNED.search(key)
        return self.stores[int(m[1]) % len(self.stores) if m else self.own]

    def _writes(self, key: str) -> list[Any]:
        """The stores ``key`` is written to, the first one's answer the one returned."""
        return [self._of(key)] if _OWNED.search(key) else self.stores

    # --- torch.distributed.Store ------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        for s in self._writes(key):
            s.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._of(key).get(key))

    def add(self, key: str, amount: int) -> int:
        first, *rest = self._writes(key)
        out = int(first.add(key, amount))
        for s in rest:
            s.add(key, amount)
        return out

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        first, *rest = self._writes(key)
        out = bytes(first.compare_set(key, expected, desired))
        for s in rest:
            s.compare_set(key, expected, desired)
        return out

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._of(k).check([k]) for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for k in keys:
            if deadline is None:
                self._of(k).wait([k])
            else:
                self._of(k).wait([k], timedelta(seconds=max(0.0, deadline - time.monotonic())))

    def delete_key(self, key: str) -> bool:
        first, *rest = self._writes(key)
        out = bool(first.delete_key(key))
        for s in rest:
            s.delete_key(key)
        return out

    def num_keys(self) -> int:
        """The first store's keys (every key but the other stores' members' arrivals)."""
        return int(self.stores[0].num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        for s in self.stores:
            s.set_timeout(timeout)

    def clone(self) -> SpreadStore:
        """The same stores through clients of their own (Gloo clones the store for its threads); kept referenced
        here: the C++ side holds it but does not keep its Python object alive."""
        twin = SpreadStore([s.clone() for s in self.stores], self.own)
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Close every store's client."""
        for s in self.stores:
            s.close()
