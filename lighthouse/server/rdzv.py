"""The gRPC handlers of ``fthsdp.v1.Rendezvous`` (docs/design.md §5): the data plane's rendezvous store, on the
lighthouse's own port, so the same TLS and job-token interceptor guard it (a replica's credential: its own job's
table only; a reader's: none). Blocking ``Get``/``Wait`` are awaited
on the event loop (no thread held per waiter) and bounded; only the leader serves (a follower redirects)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from lighthouse.metrics import LighthouseMetrics
from lighthouse.rendezvous_ops import METHODS, LiveTable, Req, Resp
from lighthouse.security import Authority
from lighthouse.server.jobs import Job
from lighthouse.server.leadership import Leadership
from lighthouse.server.service import _parser, guarded

SERVICE = "fthsdp.v1.Rendezvous"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class RendezvousService:
    """The handlers, over the jobs of one lighthouse (their tables live as long as the process)."""

    def __init__(self, jobs: dict[str, Job], leadership: Leadership, metrics: LighthouseMetrics,
                 auth: Authority | None = None) -> None:
        self.jobs = jobs
        self.auth = auth if auth is not None else Authority(None)
        self.leadership = leadership
        self.metrics = metrics
        self._tables: dict[str, LiveTable] = {}

    def handlers(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(self._guard(name), request_deserializer=_parser(Req),
                                                      response_serializer=Resp.SerializeToString)
            for name in METHODS})

    def _guard(self, name: str) -> Callable[[Any, Context], Awaitable[Any]]:
        """``name`` on the request's job table and namespace, behind the lighthouse's common guard."""
        method = f"Rendezvous.{name}"

        async def on_job(req: Req, context: Context) -> Resp:
            await self.auth.check(context, method, req.job_id)  # a replica's credential: its own job only
            job = self.jobs.get(req.job_id)
            if job is None:
                self.metrics.rpc_error(method, "NOT_FOUND")
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {req.job_id[:64]!r}")
            assert job is not None
            live = self._tables.get(job.job_id)
            if live is None:
                live = self._tables[job.job_id] = LiveTable(job.job_id)
            self.metrics.rendezvous_calls.labels(job.job_id).inc()
            epoch = job.state.epoch
            ns = live.namespace(req, job.number, epoch.data_plane if epoch is not None else 0)
            return await live.call(name, req, ns)

        return guarded(self.leadership, self.metrics, method, on_job)
