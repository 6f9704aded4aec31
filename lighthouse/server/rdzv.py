"""The gRPC handlers of ``fthsdp.v1.Rendezvous`` (docs/design.md §5): the data plane's rendezvous store, on the
lighthouse's own port, so the same TLS and job-token interceptor guard it (a replica's credential: its own job's
table only; a reader's: none). Blocking ``Get``/``Wait`` are awaited
on the event loop (no thread held per waiter) and bounded; only the leader serves (a follower redirects)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from lighthouse.metrics import LighthouseMetrics
from lighthouse.rendezvous import Namespace, RendezvousTable, check_keys, check_wait
from lighthouse.security import Authority
from lighthouse.server.jobs import Job
from lighthouse.server.leadership import Leadership
from lighthouse.server.service import _parser, guarded
from lighthouse.v1 import lighthouse_pb2 as pb

SERVICE = "fthsdp.v1.Rendezvous"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Req: TypeAlias = pb.RendezvousRequest
Resp: TypeAlias = pb.RendezvousResponse


class _JobRendezvous:
    """One job's table and the event its waiters wake on (replaced after every change)."""

    def __init__(self, job_id: str) -> None:
        self.table = RendezvousTable(job_id)
        self.changed = asyncio.Event()

    def touch(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class RendezvousService:
    """The handlers, over the jobs of one lighthouse (their tables live as long as the process)."""

    def __init__(self, jobs: dict[str, Job], leadership: Leadership, metrics: LighthouseMetrics,
                 auth: Authority | None = None) -> None:
        self.jobs = jobs
        self.auth = auth if auth is not None else Authority(None)
        self.leadership = leadership
        self.metrics = metrics
        self._tables: dict[str, _JobRendezvous] = {}

    def handlers(self) -> grpc.GenericRpcHandler[Any, Any]:
        def unary(name: str, fn: Callable[[Req, _JobRendezvous, Namespace], Awaitable[Resp]]) -> Any:
            return grpc.unary_unary_rpc_method_handler(self._guard(name, fn), request_deserializer=_parser(Req),
                                                       response_serializer=Resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Set": unary("Set", self._set), "Get": unary("Get", self._get), "Add": unary("Add", self._add),
            "CompareSet": unary("CompareSet", self._compare_set), "Check": unary("Check", self._check),
            "Wait": unary("Wait", self._wait), "DeleteKey": unary("DeleteKey", self._delete),
            "NumKeys": unary("NumKeys", self._num_keys),
        })

    def _guard(self, name: str, fn: Callable[[Req, _JobRendezvous, Namespace], Awaitable[Resp]]) -> Callable[
            [Any, Context], Awaitable[Any]]:
        """``fn`` on the request's job table and namespace, behind the lighthouse's common guard."""
        method = f"Rendezvous.{name}"

        async def on_job(req: Req, context: Context) -> Resp:
            await self.auth.check(context, method, req.job_id)  # a replica's credential: its own job only
            job = self.jobs.get(req.job_id)
            if job is None:
                self.metrics.rpc_error(method, "NOT_FOUND")
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {req.job_id[:64]!r}")
            assert job is not None
            rdzv = self._tables.get(job.job_id)
            if rdzv is None:
                rdzv = self._tables[job.job_id] = _JobRendezvous(job.job_id)
            epoch = job.state.epoch
            _, ns = rdzv.table.namespace(req.namespace, job.number, epoch.data_plane if epoch is not None else 0)
            return await fn(req, rdzv, ns)

        return guarded(self.leadership, self.metrics, method, on_job)

    async def _set(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        (key,) = check_keys(list(req.keys), rdzv.table.limits, one=True)
        rdzv.table.set(ns, key, req.value)
        rdzv.touch()
        return Resp()

    async def _add(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        (key,) = check_keys(list(req.keys), rdzv.table.limits, one=True)
        value = rdzv.table.add(ns, key, req.amount)
        rdzv.touch()
        return Resp(number=value)

    async def _compare_set(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        (key,) = check_keys(list(req.keys), rdzv.table.limits, one=True)
        value = rdzv.table.compare_set(ns, key, req.expected, req.value)
        rdzv.touch()
        return Resp(value=value)

    async def _delete(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        (key,) = check_keys(list(req.keys), rdzv.table.limits, one=True)
        existed = rdzv.table.delete(ns, key)
        rdzv.touch()
        return Resp(ok=existed)

    async def _check(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        return Resp(ok=ns.has(check_keys(list(req.keys), rdzv.table.limits)))

    async def _num_keys(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        return Resp(number=len(ns.values))

    async def _until(self, rdzv: _JobRendezvous, ns: Namespace, keys: list[str], timeout_s: float) -> bool:
        """Wait (on the loop) until ``keys`` exist in ``ns`` or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not ns.has(keys):
            left = deadline - time.monotonic()
            if left <= 0 or rdzv.table.namespaces.get(_number(ns, rdzv)) is not ns:
                return False
            changed = rdzv.changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return ns.has(keys)
        return True

    async def _get(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        keys = check_keys(list(req.keys), rdzv.table.limits, one=True)
        if not await self._until(rdzv, ns, keys, check_wait(req.timeout_s, rdzv.table.limits)):
            return Resp(ok=False)
        return Resp(ok=True, value=ns.values[keys[0]])

    async def _wait(self, req: Req, rdzv: _JobRendezvous, ns: Namespace) -> Resp:
        keys = check_keys(list(req.keys), rdzv.table.limits)
        return Resp(ok=await self._until(rdzv, ns, keys, check_wait(req.timeout_s, rdzv.table.limits)))


def _number(ns: Namespace, rdzv: _JobRendezvous) -> int:
    """The epoch number ``ns`` is kept under (0 once it was dropped)."""
    return next((n for n, x in rdzv.table.namespaces.items() if x is ns), 0)
