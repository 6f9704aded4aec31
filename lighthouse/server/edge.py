"""The membership decision at the edge: apply one event to a job (decide, persist a new epoch, publish it to
the watchers) and keep liveness in step with the membership."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable

from lighthouse import membership as m
from lighthouse import stragglers
from lighthouse.errors import EpochFenced, StoreUnavailable
from lighthouse.events import Registered
from lighthouse.metrics import LighthouseMetrics
from lighthouse.server.jobs import Job, clock
from lighthouse.state_doc import durable_change, state_to_doc
from lighthouse.stores.base import Store

log = logging.getLogger("fthsdp.lighthouse")
STORE_ERROR_LOG_S = 5.0
"""At most one log line per job this often about failed store writes (the tick retries 20 times a second)."""


def _changed_members(before: m.State, after: m.State, event: m.Event) -> tuple[Iterable[str], Iterable[str]]:
    """The replica ids ``event`` added to the members and removed from them. A plain registration (the bootstrap's
    thousands) adds its registrant and nothing else: known without comparing every member's id."""
    if after.members is before.members:
        return (), ()
    if (isinstance(event, m.Register) and len(after.members) == len(before.members) + 1
            and event.replica_id not in before.members and event.replica_id in after.members):
        return (event.replica_id,), ()
    return after.members.keys() - before.members.keys(), before.members.keys() - after.members.keys()


LOG_MEMBERS_UP_TO = 32
"""An epoch's log line names its members up to this many; a larger one gives its counts per role (a line per epoch
of 10,000 names would be 200 KB, written on the event loop at every change)."""


def _members_text(members: tuple[m.EpochMember, ...]) -> str:
    if len(members) <= LOG_MEMBERS_UP_TO:
        return ",".join(f"{x.replica_id}:{x.role}" + ("" if x.slot == m.NO_SLOT else f":slot{x.slot}") for x in members)
    roles = collections.Counter(x.role for x in members)
    return f"{len(members)} ({', '.join(f'{n} {role}' for role, n in sorted(roles.items()))})"


class Edge:
    """Feeds events into ``membership.decide`` for the jobs of one lighthouse."""

    def __init__(self, store: Store, policy: m.Policy, metrics: LighthouseMetrics) -> None:
        self.store = store
        self.policy = policy
        self.metrics = metrics
        self._store_error_logged: dict[str, float] = {}
        self.last_change = clock()
        """When an epoch was last published (``clock()``): the garbage collector's quiet time counts from it."""

    async def apply(self, job: Job, event: m.Event) -> m.Outcome:
        """Decide ``event``; persist and publish the epoch it forms. A write the store refuses (fenced, or
        unavailable) changes nothing and comes back as an UNAVAILABLE rejection."""
        async with job.write_lock:
            before = job.state
            out = m.decide(before, event, self.policy)
            if out.rejection is not None or out.state is before:
                return out
            new_epoch = out.new_epoch(before)
            if durable_change(before, out.state):
                try:
                    await self._save(job, before, out.state)
                except EpochFenced as e:
                    self._store_error(job, "fenced", f"store write fenced, change dropped: {e}")
                    return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", f"store write fenced: {e}"))
                except StoreUnavailable as e:
                    self._store_error(job, "unavailable", f"store unavailable, change waits: {e}")
                    return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", f"store unavailable: {e}"))
            job.state = out.state
            added, removed = _changed_members(before, out.state, event)
            job.joined(added, clock())
            for rid in removed:
                job.last_seen.pop(rid, None)
                job.steps.pop(rid, None)
                job.digests.pop(rid, None)
                job.paces.pop(rid, None)
        if new_epoch is not None:
            self._publish(job, new_epoch)
        elif out.events:
            # A bootstrap's registrations (thousands, before the first epoch) are told at DEBUG: the first epoch says
            # who is in it.
            quiet = job.number == 0 and all(isinstance(e, Registered) for e in out.events)
            level = logging.DEBUG if quiet else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "lighthouse job=%s epoch=%d %s", job.job_id, job.number, out.reason)
        return out

    async def tick(self, job: Job, disconnected: frozenset[str] = frozenset(),
                   gone: dict[str, str] | None = None) -> None:
        """One liveness check of ``job`` (the members due for their timeout, the suspects, ``disconnected``: the
        suspects whose connection just closed, ``gone``: members whose endpoint refused a connection after their
        session closed, id -> incarnation); under the ``eject`` fail-slow policy, at most once per heartbeat
        interval, one straggler ejected when that wins (``lighthouse.ejection``)."""
        now = clock()
        due = job.deadlines.due(now, job.last_seen)
        await self.apply(job, m.Tick(now=now, last_seen=job.last_seen, due=due, disconnected=disconnected,
                                     gone=gone or {}))
        if self.policy.straggler_policy == "eject" and now - job.stragglers_checked >= self.policy.heartbeat_interval_s:
            job.stragglers_checked = now
            await self._eject_slowest(job, now)

    async def _eject_slowest(self, job: Job, now: float) -> None:
        found = stragglers.assess(stragglers.training_paces(job.state, job.paces), self.policy.straggler_factor,
                                  self.policy.straggler_confirm)
        # Never two on one window: a run of slow reports counts only once every report in it ends past the last
        # ejection (each is a median over the PACE_WINDOW steps before it).
        slow = next((x for x in found if x.since_step >= job.last_eject_step + stragglers.PACE_WINDOW), None)
        if slow is None:
            return
        member = job.state.members.get(slow.replica_id)
        if member is None:
            return
        out = await self.apply(job, m.Eject(slow.replica_id, member.incarnation, now, slow.slowdown,
                                            slow.others_wait_s, slow.since_step))
        if out.rejection is None:
            job.ejected.add(slow.replica_id)
            job.last_eject_step = max(job.steps.values(), default=slow.since_step)
            log.warning("lighthouse job=%s epoch=%d ejected %s", job.job_id, job.number, slow.text())

    def _store_error(self, job: Job, kind: str, message: str) -> None:
        """Count every failed write; log at most one line per job every ``STORE_ERROR_LOG_S``."""
        self.metrics.store_errors.labels(job.job_id, kind).inc()
        now = time.monotonic()
        if now - self._store_error_logged.get(job.job_id, -1e9) >= STORE_ERROR_LOG_S:
            self._store_error_logged[job.job_id] = now
            log.error("lighthouse job=%s %s", job.job_id, message)

    async def _save(self, job: Job, before: m.State, after: m.State) -> None:
        doc = state_to_doc(after)
        if self.store.capabilities.in_process:
            self.store.save(job.job_id, before.last_number, doc)
        else:
            await asyncio.to_thread(self.store.save, job.job_id, before.last_number, doc)

    def _publish(self, job: Job, epoch: m.Epoch) -> None:
        self.last_change = clock()
        job.set_epoch(epoch)
        self.metrics.observe_epoch(job.job_id, job.state)
        log.info("lighthouse job=%s epoch=%d members=%s reason=%s", job.job_id, epoch.number,
                 _members_text(epoch.members), epoch.reason)
        job.wake()
