"""The operations of ``fthsdp.v1.Rendezvous`` over one job's ``RendezvousTable``, on an event loop: what the
lighthouse's service (``lighthouse.server.rdzv``) and a member's lane store (``ftar.lane_store``) both serve, each
behind its own authentication. Blocking ``Get``/``Wait`` are awaited on the loop (no thread held per waiter) and
bounded (``Limits.wait_s``); a refused call raises ``RendezvousRefused`` and changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from lighthouse.rendezvous import KEEP_EPOCHS, Limits, Namespace, RendezvousTable, check_keys, check_wait
from lighthouse.v1 import lighthouse_pb2 as pb

Req = pb.RendezvousRequest
Resp = pb.RendezvousResponse
METHODS = ("Set", "Get", "Add", "CompareSet", "Check", "Wait", "DeleteKey", "NumKeys")
"""The service's methods."""


class LiveTable:
    """One job's table and its waiters: a blocked ``Get``/``Wait`` waits for one missing key at a time, woken only by
    a write of that key (or its namespace's drop), so that a lane of N members waiting for each other's keys costs
    the store O(N) wake-ups, not one per waiter per write."""

    def __init__(self, job_id: str, limits: Limits | None = None) -> None:
        self.table = RendezvousTable(job_id, limits)
        self._waiting: dict[int, dict[str, asyncio.Event]] = {}
        """id of a namespace -> key -> the event its waiters wait on (set and dropped at the key's next write)."""
        self._ops: dict[str, Callable[[Req, Namespace], Awaitable[Resp]]] = {
            "Set": self._set, "Get": self._get, "Add": self._add, "CompareSet": self._compare_set,
            "Check": self._check, "Wait": self._wait, "DeleteKey": self._delete, "NumKeys": self._num_keys}

    def namespace(self, req: Req, current: int, plane: int, keep: int = KEEP_EPOCHS) -> Namespace:
        """The request's namespace, admitted while ``current`` is the job's epoch (``RendezvousTable.namespace``);
        the waiters of the namespaces it drops are woken (they find their namespace gone)."""
        before = {id(x) for x in self.table.namespaces.values()}
        try:
            return self.table.namespace(req.namespace, current, plane, keep)[1]
        finally:
            for gone in before - {id(x) for x in self.table.namespaces.values()}:
                for event in self._waiting.pop(gone, {}).values():
                    event.set()

    async def call(self, method: str, req: Req, ns: Namespace) -> Resp:
        """Run ``method`` (one of ``METHODS``) on ``ns``."""
        return await self._ops[method](req, ns)

    def _touch(self, ns: Namespace, key: str) -> None:
        event = self._waiting.get(id(ns), {}).pop(key, None)
        if event is not None:
            event.set()

    def _one(self, req: Req) -> str:
        (key,) = check_keys(list(req.keys), self.table.limits, one=True)
        return key

    async def _set(self, req: Req, ns: Namespace) -> Resp:
        key = self._one(req)
        self.table.set(ns, key, req.value)
        self._touch(ns, key)
        return Resp()

    async def _add(self, req: Req, ns: Namespace) -> Resp:
        key = self._one(req)
        value = self.table.add(ns, key, req.amount)
        self._touch(ns, key)
        return Resp(number=value)

    async def _compare_set(self, req: Req, ns: Namespace) -> Resp:
        key = self._one(req)
        value = self.table.compare_set(ns, key, req.expected, req.value)
        self._touch(ns, key)
        return Resp(value=value)

    async def _delete(self, req: Req, ns: Namespace) -> Resp:
        key = self._one(req)
        existed = self.table.delete(ns, key)
        self._touch(ns, key)
        return Resp(ok=existed)

    async def _check(self, req: Req, ns: Namespace) -> Resp:
        return Resp(ok=ns.has(check_keys(list(req.keys), self.table.limits)))

    async def _num_keys(self, req: Req, ns: Namespace) -> Resp:
        return Resp(number=len(ns.values))

    async def _until(self, ns: Namespace, keys: list[str], timeout_s: float) -> bool:
        """Wait (on the loop) until ``keys`` exist in ``ns`` or ``timeout_s`` passed (or ``ns`` was dropped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = next((k for k in keys if k not in ns.values), None)
            if missing is None:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not any(x is ns for x in self.table.namespaces.values()):
                return False
            event = self._waiting.setdefault(id(ns), {}).setdefault(missing, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return ns.has(keys)

    async def _get(self, req: Req, ns: Namespace) -> Resp:
        key = self._one(req)
        if not await self._until(ns, [key], check_wait(req.timeout_s, self.table.limits)):
            return Resp(ok=False)
        return Resp(ok=True, value=ns.values[key])

    async def _wait(self, req: Req, ns: Namespace) -> Resp:
        keys = check_keys(list(req.keys), self.table.limits)
        return Resp(ok=await self._until(ns, keys, check_wait(req.timeout_s, self.table.limits)))
