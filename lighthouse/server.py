"""The lighthouse gRPC server (grpc.aio): validates requests, feeds the membership decision, persists, and
pushes every new epoch to the watchers.

All job state is touched only on the server's event loop, so handlers need no locks except around the
(possibly slow) store write. Heartbeats take a fast path: they only stamp ``last_seen``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse import membership as m
from lighthouse import wire
from lighthouse.errors import EpochFenced, StoreUnavailable
from lighthouse.metrics import LighthouseMetrics
from lighthouse.security import LEADER_METADATA, ServerSecurity, TokenInterceptor
from lighthouse.store import InMemoryStore, Store

log = logging.getLogger("fthsdp.lighthouse")

SERVICE = "fthsdp.v1.Lighthouse"
STATUS_HISTORY = 32
"""Epochs a status answer lists (the newest): at 1,000 replicas all 256 kept would make it about 4 MB."""
_CLOCK_OFFSET = time.time() - time.monotonic()


def clock() -> float:
    """Seconds since the Unix epoch, advancing monotonically (wall-clock jumps do not kill anyone)."""
    return time.monotonic() + _CLOCK_OFFSET


@dataclass(frozen=True)
class LighthouseConfig:
    """How to run a lighthouse. Addresses are ``host:port``; port 0 picks a free one."""

    bind: str = "127.0.0.1:29510"
    http: str | None = "127.0.0.1:29511"
    """HTTP side port for /status, /metrics and the page at /; None: off."""
    jobs: tuple[str, ...] = ("default",)
    """Jobs this lighthouse serves; a request for any other job is NOT_FOUND."""
    policy: m.Policy = field(default_factory=m.Policy)
    rendezvous: bool = True
    """Host a TCPStore for the epochs' data-plane rendezvous (so no replica holds it)."""
    tick_s: float = 0.05
    """How often liveness is checked."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS (gRPC and HTTP) and the job token; the default is plaintext without a token (embedded use)."""
    advertise: str = ""
    """The gRPC address other lighthouses name as the leader's (HA); default: the bind host and bound port."""
    election_ttl_s: int = 5
    """HA on an etcd store: the leader's lease; a dead leader is replaced within about this long."""
    failover_grace_s: float | None = None
    """A lighthouse that takes over gives restored members this long on top of the heartbeat timeout to find
    it (clients back off and rotate addresses); None: one heartbeat timeout."""


def _is_etcd(store: Store) -> bool:
    """Whether ``store`` is an ``EtcdStore`` (HA), without importing the etcd client for the embedded default."""
    mod = sys.modules.get("lighthouse.store_etcd")
    return mod is not None and isinstance(store, mod.EtcdStore)


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return cls.FromString(raw)
        except (DecodeError, ValueError) as e:  # surfaced as INVALID_ARGUMENT by the handler
            return _Malformed(e)
    return parse


def _passthrough(x: bytes | Any) -> bytes:
    return x if isinstance(x, bytes) else x.SerializeToString()


class _Job:
    """One job's state on the server."""

    def __init__(self, job_id: str, state: m.State, rendezvous: str) -> None:
        self.job_id = job_id
        self.state = state
        self.rendezvous = rendezvous
        self.last_seen: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.write_lock = asyncio.Lock()
        self.changed = asyncio.Event()
        """Set (and replaced by a fresh one) whenever a new epoch is published or the server stops. An Event wakes
        every watcher in one go; a Condition would hand its lock from watcher to watcher, one loop iteration
        each, which delays the last of a thousand watchers by the whole chain."""
        self.epoch_pb = wire.epoch_to_pb(job_id, state.epoch, rendezvous)
        self.epoch_bytes = self.epoch_pb.SerializeToString()

    @property
    def number(self) -> int:
        return self.state.epoch.number if self.state.epoch is not None else 0

    def wake(self) -> None:
        """Wake every watcher."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class Lighthouse:
    """The servicer plus its background tasks. Use ``start()``/``stop()`` inside a running event loop."""

    def __init__(self, config: LighthouseConfig, store: Store | None = None) -> None:
        self.config = config
        self.policy = config.policy
        self.store = store if store is not None else InMemoryStore()
        self.metrics = LighthouseMetrics()
        self.jobs: dict[str, _Job] = {}
        self.port = 0
        self.http_port = 0
        self.rendezvous_addr = ""
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tcp_store: Any = None
        self._http: Any = None
        self._stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.leading = True
        """Whether this lighthouse serves (always, without an election; with one, only while it leads)."""
        self.leader_address = ""
        """Where the leader is, as last known ('' when none is known; our own address while leading)."""
        self.address = ""
        """This lighthouse's advertised gRPC address."""
        self.election: Any = None
        self._store_error_logged: dict[str, float] = {}

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        host = self.config.bind.rsplit(":", 1)[0]
        if self.config.rendezvous:
            from torch.distributed import TCPStore  # imported here: the lighthouse can run without it

            self._tcp_store = TCPStore(host.strip("[]"), 0, is_master=True, wait_for_workers=False)
            self.rendezvous_addr = f"{host}:{self._tcp_store.port}"
        for job_id in self.config.jobs:
            wire.check_id("job", job_id)
            try:
                doc = await asyncio.to_thread(self.store.load, job_id)
            except StoreUnavailable as e:
                if not _is_etcd(self.store):
                    raise
                # HA: start as a follower anyway; whoever leads loads the state when it takes over.
                log.warning("lighthouse job=%s: store unavailable at start (%s); following until it answers",
                            job_id, e)
                doc = None
            state = wire.state_from_doc(doc, clock()) if doc else m.State()
            job = _Job(job_id, state, self.rendezvous_addr)
            now = clock()
            job.last_seen = {rid: now for rid in state.members}
            self.jobs[job_id] = job
            self.metrics.observe_epoch(job_id, job.number, state)
        if _is_etcd(self.store):
            self.leading = False  # until elected
        sec = self.config.security
        interceptors = [TokenInterceptor(sec.token, lambda: self.metrics.rpc_error("any", "UNAUTHENTICATED"))] \
            if sec.token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self._server.add_generic_rpc_handlers((self._handlers(),))
        reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), self._server)
        creds = sec.grpc_credentials()
        self.port = (self._server.add_secure_port(self.config.bind, creds) if creds is not None
                     else self._server.add_insecure_port(self.config.bind))
        if self.port == 0:
            raise OSError(f"cannot bind lighthouse to {self.config.bind}")
        await self._server.start()
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="lighthouse-tick"))
        if self.config.http:
            from lighthouse.http import StatusHTTPServer

            self._http = StatusHTTPServer(self, self.config.http)
            self.http_port = self._http.port
        self.address = self.config.advertise or f"{host}:{self.port}"
        self.leader_address = self.address if self.leading else ""
        self.metrics.leader.set(1 if self.leading else 0)
        await self._start_election()
        log.info("lighthouse serving jobs=%s grpc=%s:%d http=%s rendezvous=%s min_replicas=%d "
                 "heartbeat_timeout_s=%.2f tls=%s mtls=%s token=%s election=%s", ",".join(self.jobs), host,
                 self.port, f"{self.config.http.rsplit(':', 1)[0]}:{self.http_port}" if self._http else "off",
                 self.rendezvous_addr or "off", self.policy.min_replicas, self.policy.heartbeat_timeout_s,
                 sec.tls, bool(sec.tls_client_ca), bool(sec.token), self.election is not None)

    # --- HA: leadership on an etcd store --------------------------------------------------------------------

    async def _start_election(self) -> None:
        if not _is_etcd(self.store):
            return
        from lighthouse.election import Election

        loop = self.loop
        assert loop is not None
        http = f"{self.config.http.rsplit(':', 1)[0]}:{self.http_port}" if self._http else ""

        changes: list[asyncio.Task[None]] = []

        def follow(leading: bool, leader: str) -> None:
            task = loop.create_task(self._leadership(leading, leader), name="lighthouse-leadership")
            self._tasks.append(task)
            changes.append(task)

        def on_change(leading: bool, leader: str) -> None:  # on the election thread
            loop.call_soon_threadsafe(follow, leading, leader)

        self.election = Election(self.store, self.address, http, on_change, ttl_s=self.config.election_ttl_s)
        # The first round runs now, so that a lone lighthouse serves as soon as start() returns. Its change
        # was queued on this loop before the thread's result: the task exists once we resume.
        await asyncio.to_thread(self.election.first_round)
        await asyncio.gather(*changes)
        self.election.start()

    async def _leadership(self, leading: bool, leader: str) -> None:
        """Follow the election: a new leader reloads every job from the store (numbers carry on from the
        stored ones, never back), and gives restored members a grace period; a deposed one stops serving."""
        if not leading:
            self.leading = False
            self.metrics.leader.set(0)
            self.leader_address = leader
            log.warning("lighthouse %s follows; leader=%s", self.address, leader or "unknown")
            for job in self.jobs.values():
                job.wake()  # watch streams end with a redirect
            return
        grace = self.policy.heartbeat_timeout_s if self.config.failover_grace_s is None \
            else self.config.failover_grace_s
        for job in self.jobs.values():
            async with job.write_lock:
                backoff = 0.1
                while True:
                    try:
                        doc = await asyncio.to_thread(self.store.load, job.job_id)
                        break
                    except StoreUnavailable as e:
                        # Holding the lease without serving would block the others: retry while we lead (if
                        # etcd stays away, the election steps us down once the lease must have expired).
                        if self._stopping or self.election is None or not self.election.leading:
                            log.error("lighthouse job=%s gave up loading state on taking over: %s", job.job_id, e)
                            return
                        log.warning("lighthouse job=%s cannot load state on taking over (retrying): %s",
                                    job.job_id, e)
                        await asyncio.sleep(backoff)  # retry pacing, bounded by the lease
                        backoff = min(1.0, backoff * 2)
                now = clock()
                job.state = wire.state_from_doc(doc, now) if doc else m.State()
                job.last_seen = {rid: now + grace for rid in job.state.members}
                job.steps = {}
                job.epoch_pb = wire.epoch_to_pb(job.job_id, job.state.epoch, job.rendezvous)
                job.epoch_bytes = job.epoch_pb.SerializeToString()
                self.metrics.observe_epoch(job.job_id, job.number, job.state)
        if self.election is not None and not self.election.leading:
            return  # lost it again while loading
        self.leading = True
        self.metrics.leader.set(1)
        self.leader_address = self.address
        log.warning("lighthouse %s leads: jobs=%s epochs=%s grace_s=%.1f", self.address, ",".join(self.jobs),
                    ",".join(str(j.number) for j in self.jobs.values()), grace)
        for job in self.jobs.values():
            job.wake()

    async def _not_leader(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Refuse with UNAVAILABLE, naming the leader in trailing metadata (clients switch to it)."""
        self.metrics.rpc_error(method, "UNAVAILABLE")
        leader = self.leader_address if self.leader_address != self.address else ""
        context.set_trailing_metadata(((LEADER_METADATA, leader),))
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"this lighthouse does not lead; the leader is at {leader}" if leader
                            else "this lighthouse does not lead and no leader is elected yet")

    async def stop(self, grace: float = 1.0) -> None:
        self._stopping = True
        if self.election is not None:
            await asyncio.to_thread(self.election.stop)
        for job in self.jobs.values():
            job.wake()
        for t in self._tasks:
            t.cancel()
        if self._http is not None:
            self._http.close()
        if self._server is not None:
            await self._server.stop(grace)
        self.store.close()
        self._tcp_store = None

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # --- the decision at the edge ---------------------------------------------------------------------------

    async def _apply(self, job: _Job, event: m.Event) -> m.Outcome:
        async with job.write_lock:
            before = job.state
            out = m.decide(before, event, self.policy)
            if out.rejection is not None or out.state is before:
                return out
            new_epoch = out.new_epoch(before)
            if new_epoch is not None:
                try:
                    await self._save(job, before, out.state)
                except EpochFenced as e:
                    self._store_error(job, "fenced", f"store write fenced, change dropped: {e}")
                    return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", f"store write fenced: {e}"))
                except StoreUnavailable as e:
                    self._store_error(job, "unavailable", f"store unavailable, change waits: {e}")
                    return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", f"store unavailable: {e}"))
            job.state = out.state
            for rid in out.state.members.keys() - before.members.keys():
                job.last_seen.setdefault(rid, clock())
            for rid in before.members.keys() - out.state.members.keys():
                job.last_seen.pop(rid, None)
                job.steps.pop(rid, None)
        if new_epoch is not None:
            await self._publish(job, new_epoch)
        elif out.reason:
            log.info("lighthouse job=%s epoch=%d %s", job.job_id, job.number, out.reason)
        return out

    def _store_error(self, job: _Job, kind: str, message: str) -> None:
        """Count every failed write; log at most one line per job every 5 s (the tick retries 20 times a
        second while etcd is down)."""
        self.metrics.store_errors.labels(job.job_id, kind).inc()
        now = time.monotonic()
        if now - self._store_error_logged.get(job.job_id, -1e9) >= 5.0:
            self._store_error_logged[job.job_id] = now
            log.error("lighthouse job=%s %s", job.job_id, message)

    async def _save(self, job: _Job, before: m.State, after: m.State) -> None:
        doc = wire.state_to_doc(after)
        if isinstance(self.store, InMemoryStore):
            self.store.save(job.job_id, before.last_number, doc)
        else:
            await asyncio.to_thread(self.store.save, job.job_id, before.last_number, doc)

    async def _publish(self, job: _Job, epoch: m.Epoch) -> None:
        job.epoch_pb = wire.epoch_to_pb(job.job_id, epoch, job.rendezvous)
        job.epoch_bytes = job.epoch_pb.SerializeToString()
        self.metrics.observe_epoch(job.job_id, epoch.number, job.state)
        log.info("lighthouse job=%s epoch=%d members=%s reason=%s", job.job_id, epoch.number,
                 ",".join(f"{x.replica_id}:{x.role}" for x in epoch.members), epoch.reason)
        job.wake()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)  # a period, not synchronisation
            if not self.leading:
                continue
            for job in self.jobs.values():
                try:
                    await self._apply(job, m.Tick(now=clock(), last_seen=job.last_seen))
                except Exception:  # a bug here must not stop failure detection for good
                    log.exception("lighthouse job=%s tick failed", job.job_id)

    # --- handlers -------------------------------------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                self._guard(fn.__name__, fn), request_deserializer=_parser(req),
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
        })

    def _guard(self, name: str, fn: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Callable[..., Any]:
        """Turn malformed input and validation errors into INVALID_ARGUMENT; count errors."""

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not self.leading:
                await self._not_leader(context, name)
            if isinstance(request, _Malformed):
                self.metrics.rpc_error(name, "INVALID_ARGUMENT")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
            try:
                return await fn(request, context)
            except wire.ValidationError as e:
                self.metrics.rpc_error(name, "INVALID_ARGUMENT")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return handler

    async def _job(self, job_id: str, context: grpc.aio.ServicerContext, method: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            self.metrics.rpc_error(method, "NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown job {job_id[:64]!r}: this lighthouse serves {sorted(self.jobs)}")
        return job  # type: ignore[return-value]

    async def _refuse(self, rej: m.Rejection, context: grpc.aio.ServicerContext, method: str) -> None:
        self.metrics.rpc_error(method, rej.code)
        await context.abort(getattr(grpc.StatusCode, rej.code), rej.message)

    async def Register(self, req: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        job = await self._job(req.job_id, context, "Register")
        wire.check_id("replica_id", req.replica_id)
        wire.check_id("incarnation", req.incarnation)
        if not 1 <= req.shard_count <= wire.SHARD_MAX:
            raise wire.ValidationError(f"shard_count must be in 1..{wire.SHARD_MAX}, got {req.shard_count}")
        endpoints = wire.endpoints_from_pb(req.endpoints)
        bootstrap = job.state.epoch is None
        out = await self._apply(job, m.Register(req.replica_id, req.incarnation, req.shard_count, endpoints,
                                                clock()))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Register")
        job.last_seen[req.replica_id] = clock()
        member = job.state.members[req.replica_id]
        return pb.RegisterResponse(incarnation=member.incarnation, role=wire.ROLE_TO_PB[member.role],
                                   epoch=job.epoch_pb, heartbeat_interval_s=self.policy.heartbeat_interval_s,
                                   heartbeat_timeout_s=self.policy.heartbeat_timeout_s,
                                   resume=member.role == m.ACTIVE and not bootstrap)

    async def Heartbeat(self, req: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        job = await self._job(req.job_id, context, "Heartbeat")
        member = job.state.members.get(req.replica_id)
        if member is None:
            wire.check_id("replica_id", req.replica_id)
            await self._refuse(m.Rejection("NOT_FOUND", f"replica {req.replica_id!r} is not registered "
                                           "(or was declared dead): register again"), context, "Heartbeat")
        elif member.incarnation != req.incarnation:
            await self._refuse(m.Rejection("FAILED_PRECONDITION", f"incarnation {req.incarnation[:64]!r} of "
                                           f"replica {req.replica_id!r} was replaced"), context, "Heartbeat")
        job.last_seen[req.replica_id] = clock()
        job.steps[req.replica_id] = req.step
        self.metrics.heartbeats.inc()
        return pb.HeartbeatResponse(epoch=job.number)

    async def Watch(self, req: pb.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if not self.leading:
            await self._not_leader(context, "Watch")
        if isinstance(req, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {req.error}")
        job = await self._job(req.job_id, context, "Watch")
        sent = req.after_epoch
        self.metrics.watchers.inc()
        try:
            while not self._stopping:
                if not self.leading:
                    await self._not_leader(context, "Watch")
                if job.number > sent:
                    sent = job.number
                    yield job.epoch_bytes
                    continue
                # No await between the check above and taking the event: a publish cannot slip in between.
                await job.changed.wait()
        finally:
            self.metrics.watchers.dec()

    async def ReportFailure(self, req: pb.FailureReport,
                            context: grpc.aio.ServicerContext) -> pb.FailureReportResponse:
        job = await self._job(req.job_id, context, "ReportFailure")
        wire.check_id("reporter_replica_id", req.reporter_replica_id)
        wire.check_id("suspect_replica_id", req.suspect_replica_id)
        wire.check_text("reason", req.reason)
        out = await self._apply(job, m.Report(req.reporter_replica_id, req.reporter_incarnation,
                                              req.suspect_replica_id, req.epoch, req.reason, clock(),
                                              job.last_seen))
        if out.rejection is not None:
            self.metrics.reports.labels("refused").inc()
            await self._refuse(out.rejection, context, "ReportFailure")
        self.metrics.reports.labels("confirmed" if out.confirmed else "pending").inc()
        detail = out.reason or ("suspect already declared dead" if out.confirmed else
                                "recorded; not confirmed yet (suspect still heartbeating)")
        return pb.FailureReportResponse(confirmed=out.confirmed, detail=detail, epoch=job.number)

    async def Ready(self, req: pb.ReadyRequest, context: grpc.aio.ServicerContext) -> pb.ReadyResponse:
        job = await self._job(req.job_id, context, "Ready")
        wire.check_id("replica_id", req.replica_id)
        out = await self._apply(job, m.Ready(req.replica_id, req.incarnation, wire.role_from_pb(req.role), clock()))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Ready")
        return pb.ReadyResponse(epoch=job.number)

    async def Leave(self, req: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        job = await self._job(req.job_id, context, "Leave")
        wire.check_id("replica_id", req.replica_id)
        wire.check_text("reason", req.reason)
        out = await self._apply(job, m.Leave(req.replica_id, req.incarnation, req.reason, clock()))
        if out.rejection is not None:
            await self._refuse(out.rejection, context, "Leave")
        return pb.LeaveResponse(epoch=job.number)

    async def Status(self, req: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        job = await self._job(req.job_id, context, "Status")
        now = clock()
        st = job.state
        in_epoch = set(st.epoch.replica_ids() if st.epoch else ())
        return pb.StatusResponse(
            epoch=job.epoch_pb,
            members=[pb.MemberStatus(replica_id=x.replica_id, incarnation=x.incarnation,
                                     role=wire.ROLE_TO_PB[x.role], in_epoch=x.replica_id in in_epoch,
                                     last_heartbeat_age_s=max(0.0, now - job.last_seen.get(x.replica_id,
                                                                                           x.registered_at)),
                                     step=job.steps.get(x.replica_id, 0))
                     for x in sorted(st.members.values(), key=lambda x: x.replica_id)],
            history=[pb.HistoryEntry(epoch=e.number, created_unix=e.created_at, reason=e.reason,
                                     members=list(e.replica_ids())) for e in st.history[-STATUS_HISTORY:]],
            leader=True,
        )

    # --- for the HTTP side port -------------------------------------------------------------------------------

    async def status_dict(self, job_id: str | None = None) -> dict[str, Any]:
        """The JSON of ``GET /status``."""
        job = self.jobs[job_id] if job_id else next(iter(self.jobs.values()))
        now = clock()
        st = job.state
        if not self.leading:
            # A follower's memory is stale: report what the store holds, and where the leader is.
            try:
                doc = await asyncio.to_thread(self.store.load, job.job_id)
                st = wire.state_from_doc(doc, now) if doc else m.State()
            except StoreUnavailable:
                pass
        in_epoch = set(st.epoch.replica_ids() if st.epoch else ())
        return {
            "job": job.job_id,
            "leader": self.leading,
            "leader_address": self.leader_address,
            "address": self.address,
            "epoch": st.epoch.number if st.epoch is not None else 0,
            "rendezvous": job.epoch_pb.rendezvous,
            "min_replicas": self.policy.min_replicas,
            "heartbeat_timeout_s": self.policy.heartbeat_timeout_s,
            "members": [
                {"replica_id": x.replica_id, "incarnation": x.incarnation, "role": x.role,
                 "in_epoch": x.replica_id in in_epoch,
                 "last_heartbeat_age_s": round(max(0.0, now - job.last_seen.get(x.replica_id, x.registered_at)), 3),
                 "step": job.steps.get(x.replica_id, 0)}
                for x in sorted(st.members.values(), key=lambda x: x.replica_id)
            ],
            "history": [
                {"epoch": e.number, "time": e.created_at, "reason": e.reason, "members": list(e.replica_ids())}
                for e in st.history[-STATUS_HISTORY:]
            ],
        }


async def serve(config: LighthouseConfig, store: Store | None = None,
                stop: asyncio.Event | None = None, ready: Callable[[Lighthouse], None] | None = None) -> None:
    """Run a lighthouse until ``stop`` is set (or forever)."""
    lh = Lighthouse(config, store)
    await lh.start()
    # What exists now (modules, grpc, protobuf) lives as long as the process: keep the collector from walking
    # it on every full collection, which would pause heartbeats and pushes for tens of milliseconds.
    gc.collect()
    gc.freeze()
    if ready is not None:
        ready(lh)
    try:
        if stop is None:
            await lh.wait_closed()
        else:
            await stop.wait()
    finally:
        await lh.stop()
