"""The lighthouse process's server (grpc.aio): lifecycle and wiring. ``Lighthouse`` loads the jobs from the
store, starts the gRPC service (``service``), the liveness tick (``edge``), the HTTP side port (``http``), the
data-plane rendezvous store and, on a store that elects, the election (``leadership``); ``serve`` runs one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import socket
from collections.abc import Callable
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection

from lighthouse.config import LighthouseConfig
from lighthouse.errors import StoreUnavailable
from lighthouse.metrics import LighthouseMetrics
from lighthouse.rendezvous import MEMBERS_SCHEME, SCHEME
from lighthouse.security import Authority, SecurityConfigError, TokenInterceptor, is_loopback
from lighthouse.server import status
from lighthouse.server.collector import Collector
from lighthouse.server.edge import Edge
from lighthouse.server.http import StatusHTTPServer
from lighthouse.server.jobs import Job, clock
from lighthouse.server.leadership import Leadership
from lighthouse.server.rdzv import SERVICE as RDZV_SERVICE
from lighthouse.server.rdzv import RendezvousService
from lighthouse.server.service import SERVICE, LighthouseService
from lighthouse.state_doc import state_from_doc
from lighthouse.stores.base import Store
from lighthouse.stores.factory import open_store
from lighthouse.validate import MAX_MESSAGE_BYTES, check_id

log = logging.getLogger("fthsdp.lighthouse")
SNAPSHOT_TIMEOUT_S = 5.0
"""How long the HTTP side port waits for a status snapshot from the event loop."""

PENDING_CALLS = 100_000
"""New calls gRPC's core may hold before the server takes them (its default: 1,000, rejected beyond it). When
thousands of replica groups open their sessions together (a job's start, a failover to this lighthouse) more than
1,000 arrive before the event loop takes them; gRPC then rejected the rest, which the clients saw as INTERNAL
("Failed execute_batch") and retried (measured: 300-700 of 5,000)."""


class Lighthouse:
    """A lighthouse: use ``start()``/``stop()`` inside a running event loop."""

    def __init__(self, config: LighthouseConfig, store: Store | None = None) -> None:
        self.config = config
        self.policy = config.policy
        self.store = store if store is not None else open_store(config.store)
        self.metrics = LighthouseMetrics()
        self.jobs: dict[str, Job] = {}
        self.port = 0
        self.http_port = 0
        self.rendezvous_addr = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.leadership = Leadership(config, self.store, self.jobs, self.metrics, lambda: self._stopping)
        self.edge = Edge(self.store, self.policy, self.metrics)
        auth = Authority(config.security.token, lambda method: self.metrics.rpc_error(method, "PERMISSION_DENIED"))
        self._service = LighthouseService(self.jobs, self.edge, self.leadership, self.metrics, self.policy,
                                          lambda: self._stopping, probe_timeout_s=config.probe_timeout_s, auth=auth)
        self._rendezvous = RendezvousService(self.jobs, self.leadership, self.metrics, auth)
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tcp_store: Any = None
        self._http: StatusHTTPServer | None = None
        self.collector: Collector | None = None
        """The garbage-collection policy, when this lighthouse owns its process (``serve``)."""

    @property
    def leading(self) -> bool:
        """Whether this lighthouse serves (always, without an election; with one, only while it leads)."""
        return self.leadership.leading

    @property
    def leader_address(self) -> str:
        """Where the leader is, as last known ('' when none is known; our own address while leading)."""
        return self.leadership.leader_address

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        host = self.config.host
        if self.config.rendezvous and self.config.insecure_tcp_rendezvous:
            self._host_tcp_store(host)
        elif self.config.rendezvous:
            self.rendezvous_addr = MEMBERS_SCHEME if self.config.member_rendezvous else SCHEME
        for job_id in self.config.jobs:
            check_id("job", job_id)
            self.jobs[job_id] = job = await self._load(job_id)
            self.metrics.observe_epoch(job_id, job.state)
        await self._start_grpc()
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="lighthouse-tick"))
        if self.config.http:
            self._http = StatusHTTPServer(self.config.http, self.config.security, self.metrics, self._snapshot)
            self.http_port = self._http.port
        http = f"{self.config.http.rsplit(':', 1)[0]}:{self.http_port}" if self.config.http else ""
        await self.leadership.start(self.config.advertise or f"{host}:{self.port}", http)
        sec = self.config.security
        log.info("lighthouse serving jobs=%s grpc=%s:%d http=%s rendezvous=%s min_replicas=%d "
                 "heartbeat_timeout_s=%.2f tls=%s mtls=%s token=%s election=%s", ",".join(self.jobs), host,
                 self.port, http or "off", self.rendezvous_addr or "off", self.policy.min_replicas,
                 self.policy.heartbeat_timeout_s, sec.tls, bool(sec.tls_client_ca), bool(sec.token),
                 self.leadership.election is not None)

    def _host_tcp_store(self, host: str) -> None:
        """The opt-in plain TCPStore: unauthenticated, so only on a loopback address, and said loudly. A TCPStore
        given a host still listens on every interface (torch 2.13), so it is handed a socket bound here instead."""
        if not is_loopback(host):
            raise SecurityConfigError(f"--insecure-tcp-rendezvous needs a loopback --bind (not {host!r}): a "
                                      "TCPStore has neither token nor TLS")
        from torch.distributed import TCPStore  # imported here: the lighthouse can run without it

        bare = host.strip("[]")
        sock = socket.create_server((bare, 0), family=socket.AF_INET6 if ":" in bare else socket.AF_INET)
        port = sock.getsockname()[1]
        # The store's event loop owns the descriptor from here on (and closes it).
        self._tcp_store = TCPStore(bare, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())
        self.rendezvous_addr = f"{host}:{port}"
        log.warning("lighthouse: INSECURE data-plane rendezvous: a plain TCPStore at %s (no token, no TLS; "
                    "anyone on this host can read and write it)", self.rendezvous_addr)

    async def _load(self, job_id: str) -> Job:
        try:
            doc = await asyncio.to_thread(self.store.load, job_id)
        except StoreUnavailable as e:
            if not self.store.capabilities.election:
                raise
            # HA: start as a follower anyway; whoever leads loads the state when it takes over.
            log.warning("lighthouse job=%s: store unavailable at start (%s); following until it answers",
                        job_id, e)
            doc = None
        now = clock()
        return Job(job_id, state_from_doc(doc, now), self.rendezvous_addr, now, self.policy.heartbeat_timeout_s,
                   self.config.lane_spread_from)

    async def _start_grpc(self) -> None:
        sec = self.config.security
        interceptors = [TokenInterceptor(sec.token, lambda: self.metrics.rpc_error("any", "UNAUTHENTICATED"))] \
            if sec.token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
        ])
        self._server.add_generic_rpc_handlers((self._service.handlers(),))
        services = [SERVICE, reflection.SERVICE_NAME]
        if self.rendezvous_addr in (SCHEME, MEMBERS_SCHEME):
            self._server.add_generic_rpc_handlers((self._rendezvous.handlers(),))
            services.append(RDZV_SERVICE)
        reflection.enable_server_reflection(services, self._server)
        creds = sec.grpc_credentials()
        self.port = (self._server.add_secure_port(self.config.bind, creds) if creds is not None
                     else self._server.add_insecure_port(self.config.bind))
        if self.port == 0:
            raise OSError(f"cannot bind lighthouse to {self.config.bind}")
        await self._server.start()

    async def stop(self, grace: float = 1.0) -> None:
        self._stopping = True
        await self.leadership.stop()
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

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)  # a period, not synchronisation
            if self.collector is not None:
                self.collector.tick(clock(), self.edge.last_change)
            if not self.leadership.leading:
                continue
            for job in self.jobs.values():
                try:
                    await self.edge.tick(job)
                except Exception:  # a bug here must not stop failure detection for good
                    log.exception("lighthouse job=%s tick failed", job.job_id)

    # --- the status view for the HTTP side port ---------------------------------------------------------------

    async def status_view(self, job_id: str | None = None) -> status.StatusView:
        """The status of ``job_id`` (default: the first job). A follower's memory is stale: it reports what the
        store holds, and where the leader is."""
        job = self.jobs[job_id] if job_id else next(iter(self.jobs.values()))
        now = clock()
        state = job.state
        if not self.leadership.leading:
            try:
                doc = await asyncio.to_thread(self.store.load, job.job_id)
                state = state_from_doc(doc, now)
            except StoreUnavailable:
                pass
        return status.build(job.job_id, state, last_seen=job.last_seen, steps=job.steps, digests=job.digests,
                            paces=job.paces, orphan_steps=job.orphan_steps.counts(job.step),
                            rendezvous=job.epoch_pb.rendezvous, policy=self.policy,
                            leader=self.leadership.view(), now=now)

    def _snapshot(self) -> dict[str, Any]:
        """``GET /status``, from an HTTP thread: the view taken on the event loop."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self.status_view(), self.loop)
        try:
            return status.to_json(fut.result(SNAPSHOT_TIMEOUT_S))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise


async def serve(config: LighthouseConfig, store: Store | None = None,
                stop: asyncio.Event | None = None, ready: Callable[[Lighthouse], None] | None = None) -> None:
    """Run a lighthouse until ``stop`` is set (or forever); ``store`` overrides ``config.store``."""
    lh = Lighthouse(config, store)
    await lh.start()
    # What exists now (modules, grpc, protobuf) lives as long as the process: keep the collector from walking
    # it on every full collection, which would pause heartbeats and pushes; from now on, what the sessions and
    # the state add is kept from it too, tick by tick (``lighthouse.server.collector``).
    gc.collect()
    gc.freeze()
    lh.collector = Collector(clock())
    if ready is not None:
        ready(lh)
    try:
        if stop is None:
            await lh.wait_closed()
        else:
            await stop.wait()
    finally:
        await lh.stop()
