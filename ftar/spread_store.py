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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

ARRIVED = "arrived"
"""The lane-store key prefix a member sets (``arrived/<its index in the epoch>``) as it arrives."""
_OWNED = re.compile(rf"(?:^|/){ARRIVED}/(\d+)$")
T = TypeVar("T")


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

    def _owner(self, key: str) -> int | None:
        """The store that alone holds ``key`` (an arrival's: its member's), or None for a key every store holds."""
        m = _OWNED.search(key)
        return int(m[1]) % len(self.stores) if m else None

    def _of(self, key: str) -> Any:
        """The store ``key`` is read from: its owner, else this member's own."""
        owner = self._owner(key)
        return self.stores[self.own if owner is None else owner]

    def _write(self, key: str, op: Callable[[Any], T]) -> T:
        """``op`` on every store ``key`` is written to (its owner alone, else all in order); the first's answer."""
        owner = self._owner(key)
        first, *rest = self.stores if owner is None else [self.stores[owner]]
        out = op(first)
        for s in rest:
            op(s)
        return out

    # --- torch.distributed.Store ------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._write(key, lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._of(key).get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._write(key, lambda s: s.add(key, amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._write(key, lambda s: s.compare_set(key, expected, desired)))

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._of(k).check([k]) for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Each key on the store it is read from, within one deadline for all (each store's own without one)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for k in keys:
            left = None if deadline is None else timedelta(seconds=max(0.0, deadline - time.monotonic()))
            self._of(k).wait([k], left)

    def delete_key(self, key: str) -> bool:
        return bool(self._write(key, lambda s: s.delete_key(key)))

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
