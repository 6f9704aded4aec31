"""The gRPC handlers of ``fthsdp.v1.Lighthouse``: validate each request, turn it into a membership event for the
edge (``lighthouse.server.edge``), and answer from the outcome. Refusals carry a clear status and change
nothing; a follower refuses everything with a redirect to the leader."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from lighthouse import membership as m
from lighthouse import stragglers
from lighthouse.ejection import held_out
from lighthouse.errors import ValidationError
from lighthouse.metrics import LighthouseMetrics
from lighthouse.proto_codec import ROLE_TO_PB, endpoints_from_pb, role_from_pb
from lighthouse.security import Authority
from lighthouse.server import probe, status
from lighthouse.server.edge import Edge
from lighthouse.server.jobs import Job, Waker, clock
from lighthouse.server.leadership import Leadership
from lighthouse.stragglers import Pace
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.validate import check_digest, check_epoch, check_id, check_layout, check_shard_count, check_text

log = logging.getLogger("fthsdp.lighthouse")
SERVICE = "fthsdp.v1.Lighthouse"
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # (missing from grpc's stubs)
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class _Malformed:
    """A request whose bytes did not parse (answered as INVALID_ARGUMENT by the handler)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return cls.FromString(raw)
        except (DecodeError, ValueError) as e:
            return _Malformed(e)
    return parse


def guarded(leadership: Leadership, metrics: LighthouseMetrics, name: str,
            fn: Callable[[Any, Context], Awaitable[Any]]) -> Callable[[Any, Context], Awaitable[Any]]:
    """A handler that redirects while following and turns malformed input and validation errors into
    INVALID_ARGUMENT, around ``fn`` (every service on the lighthouse's port: ``Lighthouse`` and ``Rendezvous``)."""

    async def handler(request: Any, context: Context) -> Any:
        if not leadership.leading:
            await leadership.refuse(context, name)
        if isinstance(request, _Malformed):
            metrics.rpc_error(name, "INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        try:
            return await fn(request, context)
        except ValidationError as e:
            metrics.rpc_error(name, "INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return handler


def _passthrough(x: bytes | Any) -> bytes:
    return x if isinstance(x, bytes) else x.SerializeToString()


class LighthouseService:
    """The handlers, over the jobs of one lighthouse."""

    def __init__(self, jobs: dict[str, Job], edge: Edge, leadership: Leadership, metrics: LighthouseMetrics,
                 policy: m.Policy, stopping: Callable[[], bool], probe_timeout_s: float = 0.0,
                 auth: Authority | None = None) -> None:
        self.jobs = jobs
        self.auth = auth if auth is not None else Authority(None)
        """Who may make which call (``lighthouse.security.Authority``; by default everyone: no job secret)."""
        self.edge = edge
        self.leadership = leadership
        self.metrics = metrics
        self.policy = policy
        self._stopping = stopping
        self.probe_timeout_s = probe_timeout_s
        self._background: set[asyncio.Task[None]] = set()

    def handlers(self) -> grpc.GenericRpcHandler[Any, Any]:
        def unary(fn: Callable[[Any, Context], Awaitable[Any]], req: Any, resp: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                guarded(self.leadership, self.metrics, fn.__name__, fn), request_deserializer=_parser(req),
                response_serializer=resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Register": unary(self.Register, pb.RegisterRequest, pb.RegisterResponse),
            "Heartbeat": unary(self.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "ReportFailure": unary(self.ReportFailure, pb.FailureReport, pb.FailureReportResponse),
            "Ready": unary(self.Ready, pb.ReadyRequest, pb.ReadyResponse),
            "Leave": unary(self.Leave, pb.LeaveRequest, pb.LeaveResponse),
            "Status": unary(self.Status, pb.StatusRequest, pb.StatusResponse),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.Watch, request_deserializer=_parser(pb.WatchRequest), response_serializer=_passthrough),
            "Session": grpc.stream_stream_rpc_method_handler(
                self._session_handler, request_deserializer=_parser(pb.SessionRequest),
                response_serializer=_passthrough),
        })

    async def _job(self, job_id: str, context: Context, method: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            self.metrics.rpc_error(method, "NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown job {job_id[:64]!r}: this lighthouse serves {sorted(self.jobs)}")
        return job

    async def _refuse(self, rej: m.Rejection, context: Context, method: str) -> None:
        self.metrics.rpc_error(method, rej.code)
        await context.abort(getattr(grpc.StatusCode, rej.code), rej.message)

    async def Register(self, req: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        await self.auth.check(context, "Register", req.job_id, req.replica_id)
        job = await self._job(req.job_id, context, "Register")
        check_id("replica_id", req.replica_id)
        check_id("incarnation", req.incarnation)
        check_shard_count(req.shard_count)
        endpoints = endpoints_from_pb(req.endpoints)
        claim = role_from_pb(req.role) if req.role != pb.ROLE_UNSPECIFIED else ""
        last_epoch = check_epoch("last_epoch", req.last_epoch)
        trained = job.state.epoch is not None or job.state.last_number > 0
        out = await self.edge.apply(job, m.Register(req.replica_id, req.incarnation, req.shard_count, endpoints,
                                                    clock(), claim=claim, last_epoch=last_epoch,
                                                    slot=req.slot if req.HasField("slot") else m.NO_SLOT,
                                                    slots=req.slots, layout=check_layout(req.layout)))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Register")
        if out.finished_step is not None:
            # The job completed: not registered (no incarnation, no role), nothing to heartbeat; stop.
            return pb.RegisterResponse(epoch=job.epoch_pb, heartbeat_interval_s=self.policy.heartbeat_interval_s,
                                       heartbeat_timeout_s=self.policy.heartbeat_timeout_s, finished=True,
                                       finished_step=out.finished_step)
        job.last_seen[req.replica_id] = clock()
        member = job.state.members[req.replica_id]
        return pb.RegisterResponse(incarnation=member.incarnation, role=ROLE_TO_PB[member.role],
                                   epoch=job.epoch_pb, heartbeat_interval_s=self.policy.heartbeat_interval_s,
                                   heartbeat_timeout_s=self.policy.heartbeat_timeout_s,
                                   resume=member.role == m.ACTIVE and trained and not member.reclaimed)

    async def Heartbeat(self, req: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatResponse:
        await self.auth.check(context, "Heartbeat", req.job_id, req.replica_id)
        job = await self._job(req.job_id, context, "Heartbeat")
        if (rej := self._beat(job, req)) is not None:
            await self._refuse(rej, context, "Heartbeat")
        return pb.HeartbeatResponse(epoch=job.number)

    def _beat(self, job: Job, req: pb.HeartbeatRequest) -> m.Rejection | None:
        """Take one heartbeat (unary, or a message of a session): stamp liveness and its informational payload.
        The hot path: one dict lookup, no validation, unless it is refused (then nothing is taken)."""
        if (rej := m.check_incarnation(job.state, req.replica_id, req.incarnation)) is not None:
            check_id("replica_id", req.replica_id)
            return rej
        if req.digest and not check_digest(req.digest):
            return m.Rejection("INVALID_ARGUMENT", "digest: at most 64 hexadecimal digits")
        lanes = stragglers.unpack_lanes(req.lane_wait_ms) if req.pace_step else ()
        pace = Pace(req.pace_step, req.compute_s, req.wait_s, req.busiest_rank, req.busiest_s, req.siblings_busy_s,
                    lanes or ()) if req.pace_step else None
        if pace is not None and (lanes is None or not stragglers.valid(pace)):
            return m.Rejection("INVALID_ARGUMENT",
                               f"compute_s, wait_s, busiest_s, siblings_busy_s: finite, in [0, "
                               f"{stragglers.MAX_SECONDS:g}] seconds; busiest_rank under {stragglers.MAX_RANKS}; "
                               f"lane_wait_ms: two bytes per rank, at most {stragglers.MAX_LANES} ranks")
        job.last_seen[req.replica_id] = clock()
        job.steps[req.replica_id] = req.step
        if req.digest:
            job.digests[req.replica_id] = (req.incarnation, req.digest_step, req.digest.lower())
        if pace is not None:
            inc, history = job.paces.get(req.replica_id, ("", ()))
            job.paces[req.replica_id] = (req.incarnation, stragglers.remember(
                history if inc == req.incarnation else (), pace))
        self.metrics.heartbeats.inc()
        return None

    async def Watch(self, req: pb.WatchRequest | _Malformed, context: Context) -> AsyncIterator[bytes]:
        if not self.leadership.leading:
            await self.leadership.refuse(context, "Watch")
        if isinstance(req, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {req.error}")
            return
        await self.auth.check(context, "Watch", req.job_id, req.replica_id)
        job = await self._job(req.job_id, context, "Watch")
        watcher = (req.replica_id, req.incarnation) if req.replica_id else None
        if watcher is not None:
            try:
                check_id("replica_id", req.replica_id)
                check_id("incarnation", req.incarnation)
            except ValidationError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                return
            job.stream_opened(*watcher)
        sent = req.after_epoch
        closed_by_peer = False
        self.metrics.watchers.inc()
        self.metrics.streams_opened.labels("watch").inc()
        try:
            while not self._stopping():
                if not self.leadership.leading:
                    await self.leadership.refuse(context, "Watch")
                if job.number > sent:
                    sent = job.number
                    yield job.epoch_bytes
                    continue
                # No await between the check above and taking the event: a publish cannot slip in between.
                await job.changed.wait()
        except asyncio.CancelledError:  # the replica's end went away (grpc cancels the handler)
            closed_by_peer = not self._stopping()
            raise
        finally:
            self.metrics.watchers.dec()
            if watcher is not None:
                job.stream_closed(*watcher, clock() if closed_by_peer else None)

    async def Session(self, context: Context) -> None:
        """A replica group's stream: its messages are heartbeats (the first opens it), its pushes the epochs, as
        deltas against the one pushed before. Refusals end it with a status, as Heartbeat answers them."""
        if not self.leadership.leading:
            await self.leadership.refuse(context, "Session")
        first = await context.read()
        if first is EOF:
            return
        if isinstance(first, _Malformed):
            await self._refuse(m.Rejection("INVALID_ARGUMENT", f"malformed request: {first.error}"), context,
                               "Session")
        hb = first.heartbeat
        await self.auth.check(context, "Session", hb.job_id, hb.replica_id)
        job = await self._job(hb.job_id, context, "Session")
        try:
            check_id("replica_id", hb.replica_id)
            check_id("incarnation", hb.incarnation)
        except ValidationError as e:
            await self._refuse(m.Rejection("INVALID_ARGUMENT", str(e)), context, "Session")
        if (rej := self._beat(job, hb)) is not None:
            await self._refuse(rej, context, "Session")
        rid, inc = hb.replica_id, hb.incarnation
        job.stream_opened(rid, inc)
        waker = Waker()
        resync: list[bool] = []
        reader = asyncio.create_task(self._session_beats(job, context, rid, inc, resync, waker),
                                     name=f"session-{rid}")
        reader.add_done_callback(lambda _: waker.kick())
        job.sessions.add(waker)
        held = first.after_epoch
        closed_by_peer = False
        self.metrics.sessions.inc()
        self.metrics.streams_opened.labels("session").inc()
        try:
            while not self._stopping():
                if not self.leadership.leading:
                    await self.leadership.refuse(context, "Session")
                if resync:
                    resync.clear()
                    held = 0
                if job.number > held:
                    update = job.update_for(held)
                    held = job.number
                    await context.write(update)
                    continue
                if reader.done():
                    rej = reader.result()
                    if rej is None:  # the replica closed its side: the session is over
                        closed_by_peer = not self._stopping()
                        return
                    await self._refuse(rej, context, "Session")
                # No await between the checks above and the wait: a kick in between is kept for it.
                await waker.wait()
        except asyncio.CancelledError:  # the replica's end went away (grpc cancels the handler)
            closed_by_peer = not self._stopping()
            raise
        finally:
            job.sessions.discard(waker)
            reader.cancel()
            self.metrics.sessions.dec()
            job.stream_closed(rid, inc, clock() if closed_by_peer else None)
            if closed_by_peer and rid in job.state.suspicions:
                # A reported suspect whose session closed from its end died: confirm it now (its report may have
                # come in before its connection's end did).
                self._spawn(self.edge.tick(job, disconnected=frozenset((rid,))))
            elif closed_by_peer and self.probe_timeout_s > 0:
                self._spawn(self._probe(job, rid, inc))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._background.discard)

    async def _probe(self, job: Job, rid: str, inc: str) -> None:
        """A member whose session closed from its end: dead at once if its catch-up endpoint refuses a connection
        (its process is gone) while no session of it has opened again (``lighthouse.server.probe``). A dying process
        frees its memory before its sockets close, its session's first, so a connection accepted right after the
        session closed is tried again, after 10 ms, then twice as long each time, for ``probe_timeout_s``. A member
        that left meanwhile (a graceful end leaves before it closes its endpoint) is not probed again."""
        t0 = clock()
        delay, tries = 0.01, 0
        while True:
            member = job.state.members.get(rid)
            if member is None or member.incarnation != inc or not member.endpoints.catchup or \
                    job.disconnected_s(rid, clock()) is None:
                return
            tries += 1
            refused = await probe.refused(member.endpoints.catchup, max(0.01, t0 + self.probe_timeout_s - clock()))
            if refused or clock() + delay > t0 + self.probe_timeout_s:
                break
            await asyncio.sleep(delay)  # the pace of the retries, not a synchronisation
            delay *= 2
        log.info("lighthouse job=%s epoch=%d replica=%s session closed; its endpoint %s %s (%d tries, %.3fs)",
                 job.job_id, job.number, rid, member.endpoints.catchup, "refused" if refused else "did not refuse",
                 tries, clock() - t0)
        if refused and job.disconnected_s(rid, clock()) is not None:
            await self.edge.tick(job, gone={rid: inc})

    async def _session_handler(self, requests: Any, context: Context) -> None:
        await self.Session(context)  # reads with context.read(), so that it can write while it waits for one

    async def _session_beats(self, job: Job, context: Context, rid: str, inc: str, resync: list[bool],
                             waker: Waker) -> m.Rejection | None:
        """Take a session's heartbeats until it ends (None: the replica closed its side) or one is refused."""
        while True:
            try:
                req = await context.read()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError):  # the stream broke: its end is gone
                return None
            if req is EOF:
                return None
            if isinstance(req, _Malformed):
                return m.Rejection("INVALID_ARGUMENT", f"malformed request: {req.error}")
            hb = req.heartbeat
            if (hb.replica_id, hb.incarnation, hb.job_id) != (rid, inc, job.job_id):
                return m.Rejection("INVALID_ARGUMENT", "a session's heartbeats must name its job, replica and "
                                   "incarnation")
            if (rej := self._beat(job, hb)) is not None:
                return rej
            if req.resync:
                resync.append(True)
                waker.kick()

    async def ReportFailure(self, req: pb.FailureReport, context: Context) -> pb.FailureReportResponse:
        await self.auth.check(context, "ReportFailure", req.job_id, req.reporter_replica_id)
        job = await self._job(req.job_id, context, "ReportFailure")
        check_id("reporter_replica_id", req.reporter_replica_id)
        check_id("suspect_replica_id", req.suspect_replica_id)
        check_text("reason", req.reason)
        now = clock()
        out = await self.edge.apply(job, m.Report(req.reporter_replica_id, req.reporter_incarnation,
                                                  req.suspect_replica_id, req.epoch, req.reason, now,
                                                  job.last_seen, job.disconnected_s(req.suspect_replica_id, now),
                                                  req.early, job.steps.get(req.suspect_replica_id)))
        if out.rejection is not None:
            self.metrics.reports.labels("refused").inc()
            await self._refuse(out.rejection, context, "ReportFailure")
        self.metrics.reports.labels("confirmed" if out.confirmed else "pending").inc()
        detail = out.reason or ("suspect already declared dead" if out.confirmed else
                                "early report without evidence: nothing recorded" if req.early else
                                "recorded; not confirmed yet (suspect still heartbeating)")
        return pb.FailureReportResponse(confirmed=out.confirmed, detail=detail, epoch=job.number)

    async def Ready(self, req: pb.ReadyRequest, context: Context) -> pb.ReadyResponse:
        await self.auth.check(context, "Ready", req.job_id, req.replica_id)
        job = await self._job(req.job_id, context, "Ready")
        check_id("replica_id", req.replica_id)
        role = role_from_pb(req.role)
        if not stragglers.valid_seconds(req.probe_compute_s):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"probe_compute_s: finite, in [0, {stragglers.MAX_SECONDS:g}] seconds")
        if role == m.JOINING and req.replica_id in job.ejected:
            others = [h[-1].compute_s for h in stragglers.training_paces(job.state, job.paces).values()]
            if (why := held_out(req.probe_compute_s, others, self.policy.straggler_factor)) is not None:
                await self._refuse(m.Rejection("ABORTED", why), context, "Ready")
        out = await self.edge.apply(job, m.Ready(req.replica_id, req.incarnation, role, clock()))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Ready")
        if role == m.JOINING:
            job.ejected.discard(req.replica_id)  # healthy again (or nothing to compare with): it may come back
        return pb.ReadyResponse(epoch=job.number)

    async def Leave(self, req: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        await self.auth.check(context, "Leave", req.job_id, req.replica_id)
        job = await self._job(req.job_id, context, "Leave")
        check_id("replica_id", req.replica_id)
        check_text("reason", req.reason)
        out = await self.edge.apply(job, m.Leave(req.replica_id, req.incarnation, req.reason, clock(),
                                                 step=req.step))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Leave")
        return pb.LeaveResponse(epoch=job.number)

    async def Status(self, req: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        await self.auth.check(context, "Status", req.job_id)
        job = await self._job(req.job_id, context, "Status")
        view = status.build(job.job_id, job.state, last_seen=job.last_seen, steps=job.steps, digests=job.digests,
                            paces=job.paces, orphan_steps=job.orphan_steps.counts(job.step),
                            rendezvous=job.epoch_pb.rendezvous, policy=self.policy,
                            leader=self.leadership.view(), now=clock())
        return status.to_pb(view, job.epoch_pb)
