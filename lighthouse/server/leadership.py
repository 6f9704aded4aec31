"""HA leadership of a lighthouse on a store that elects (etcd): follow the election, take over (reload every job
from the store, give restored members a grace period), step down, and refuse requests while following, naming
the leader so that clients go there.

On a store without election the lighthouse always leads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from lighthouse.backoff import Backoff
from lighthouse.config import LighthouseConfig
from lighthouse.errors import StoreUnavailable
from lighthouse.metrics import LighthouseMetrics
from lighthouse.security import LEADER_METADATA
from lighthouse.server.jobs import Job, clock
from lighthouse.server.probe import knock
from lighthouse.server.status import Leader
from lighthouse.state_doc import state_from_doc
from lighthouse.stores.base import Election, Store

log = logging.getLogger("fthsdp.lighthouse")


class Leadership:
    """Whether this lighthouse serves, and where the leader is."""

    def __init__(self, config: LighthouseConfig, store: Store, jobs: dict[str, Job], metrics: LighthouseMetrics,
                 stopping: Callable[[], bool]) -> None:
        self.config = config
        self.store = store
        self.jobs = jobs
        self.metrics = metrics
        self._stopping = stopping
        self.elects = store.capabilities.election
        self.leading = not self.elects
        """Whether this lighthouse serves (always, without an election; with one, only while it leads)."""
        self.leader_address = ""
        """Where the leader is, as last known ('' when none is known; our own address while leading)."""
        self.address = ""
        """This lighthouse's advertised gRPC address."""
        self.election: Election | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def view(self) -> Leader:
        return Leader(self.leading, self.leader_address, self.address,
                      self.election is not None and self.election.leader_reached)

    async def start(self, address: str, http: str) -> None:
        """Serve at ``address`` (``http``: the side port, '' when off); with an election, campaign now (a lone
        lighthouse leads as soon as this returns) and keep following it."""
        self.address = address
        self.leader_address = address if self.leading else ""
        self.metrics.leader.set(1 if self.leading else 0)
        if not self.elects:
            return
        loop = asyncio.get_running_loop()
        changes: list[asyncio.Task[None]] = []

        def follow(leading: bool, leader: str) -> None:
            task = loop.create_task(self.follow(leading, leader), name="lighthouse-leadership")
            self._tasks.append(task)
            changes.append(task)

        def on_change(leading: bool, leader: str) -> None:  # on the election thread
            loop.call_soon_threadsafe(follow, leading, leader)

        self.election = self.store.election(address, http, on_change, self.config.election_ttl_s,
                                            self.config.election_probe_s, knock)
        # The first round runs now, so that a lone lighthouse serves as soon as start() returns. Its change
        # was queued on this loop before the thread's result: the task exists once we resume.
        await asyncio.to_thread(self.election.first_round)
        await asyncio.gather(*changes)
        self.election.start()

    async def stop(self) -> None:
        if self.election is not None:
            await asyncio.to_thread(self.election.stop)
        for t in self._tasks:
            t.cancel()

    async def follow(self, leading: bool, leader: str) -> None:
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
        grace = self.config.policy.heartbeat_timeout_s if self.config.failover_grace_s is None \
            else self.config.failover_grace_s
        for job in self.jobs.values():
            async with job.write_lock:
                if not await self._reload(job, grace):
                    return
                self.metrics.observe_epoch(job.job_id, job.state)
        if self.election is not None and not self.election.leading:
            return  # lost it again while loading
        self.leading = True
        self.metrics.leader.set(1)
        self.leader_address = self.address
        log.warning("lighthouse %s leads: jobs=%s epochs=%s grace_s=%.1f", self.address, ",".join(self.jobs),
                    ",".join(str(j.number) for j in self.jobs.values()), grace)
        for job in self.jobs.values():
            job.wake()

    async def _reload(self, job: Job, grace: float) -> bool:
        """Restore ``job`` from the store, its members last seen ``grace`` seconds from now; False when
        leadership (or the server) ended before the store answered."""
        backoff = Backoff(first=0.1, cap=1.0)
        while True:
            try:
                doc = await asyncio.to_thread(self.store.load, job.job_id)
            except StoreUnavailable as e:
                # Holding the lease without serving would block the others: retry while we lead (if etcd
                # stays away, the election steps us down once the lease must have expired).
                if self._stopping() or self.election is None or not self.election.leading:
                    log.error("lighthouse job=%s gave up loading state on taking over: %s", job.job_id, e)
                    return False
                log.warning("lighthouse job=%s cannot load state on taking over (retrying): %s", job.job_id, e)
                await asyncio.sleep(backoff.next())  # retry pacing, bounded by the lease
                continue
            now = clock()
            job.restore(state_from_doc(doc, now), now + grace)
            return True

    async def refuse(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
        """Refuse with UNAVAILABLE, naming the leader in trailing metadata (clients switch to it)."""
        self.metrics.rpc_error(method, "UNAVAILABLE")
        leader = self.leader_address if self.leader_address != self.address else ""
        context.set_trailing_metadata(((LEADER_METADATA, leader),))
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"this lighthouse does not lead; the leader is at {leader}" if leader
                            else "this lighthouse does not lead and no leader is elected yet")
