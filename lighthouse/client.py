"""The lighthouse client of the training process (``LighthouseClient``): a thread-backed wrapper of the asyncio
session (``lighthouse.client_session``), because the training loop must never block on the lighthouse. Calls block
the caller at most their deadline; heartbeats and the epoch watch run on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from lighthouse.backoff import Backoff
from lighthouse.client_rpc import NO_ENDPOINTS, Registration, ReportResult
from lighthouse.client_session import AsyncLighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.errors import LighthouseError, LighthouseUnavailable
from lighthouse.model import NO_SLOT, Endpoints
from lighthouse.security import ClientSecurity
from lighthouse.stragglers import Pace
from lighthouse.v1 import lighthouse_pb2 as pb

log = logging.getLogger("fthsdp.lighthouse.client")
T = TypeVar("T")


class LighthouseClient:
    """Thread-backed client for the training process: calls block the caller at most ``timeout`` seconds;
    heartbeats and the epoch watch run on a private event-loop thread.

    Pushed epochs reach ``on_epoch`` (called on that thread: keep it short) and ``wait_epoch``.
    """

    def __init__(self, addresses: str | Sequence[str], job_id: str, replica_id: str, *, shard_count: int = 1,
                 endpoints: Endpoints = NO_ENDPOINTS, rpc_timeout_s: float = 2.0,
                 on_epoch: Callable[[EpochView], None] | None = None,
                 on_lost: Callable[[str], None] | None = None, incarnation: str | None = None,
                 security: ClientSecurity | None = None, slot: int = NO_SLOT, slots: int = 0,
                 layout: str = "") -> None:
        self._on_epoch = on_epoch
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._latest: EpochView | None = None
        self._step = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-{replica_id}", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._session: concurrent.futures.Future[None] | None = None
        self.rpc_timeout_s = rpc_timeout_s
        # The channel is made lazily, on the loop thread, by the first call.
        self.aio = AsyncLighthouseClient(addresses, job_id, replica_id, shard_count=shard_count,
                                         endpoints=endpoints, rpc_timeout_s=rpc_timeout_s, incarnation=incarnation,
                                         security=security, slot=slot, slots=slots, layout=layout)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout if timeout is not None else self.rpc_timeout_s + 1.0)
        except TimeoutError:
            fut.cancel()
            raise LighthouseUnavailable("lighthouse call did not finish within its deadline") from None

    @property
    def replica_id(self) -> str:
        return self.aio.replica_id

    @property
    def incarnation(self) -> str:
        return self.aio.incarnation

    def deliver(self, e: EpochView) -> None:
        """Take ``e`` as pushed (ignored unless newer than the newest known): the session's own epochs, or, on a rank
        that holds no session, those its group's rank 0 relays (``fthsdp.runtime.epoch_relay``)."""
        with self._cond:
            if self._latest is not None and e.number <= self._latest.number:
                return
            self._latest = e
            self._cond.notify_all()
        if self._on_epoch is not None:
            self._on_epoch(e)

    def start(self, deadline_s: float = 30.0) -> Registration:
        """Register (retrying until ``deadline_s``) and start the session: heartbeats up, epochs down. A group's
        other ranks do not start theirs: its rank 0 relays the epochs to them (``fthsdp.runtime.epoch_relay``)."""
        if self._session is not None:
            raise RuntimeError("LighthouseClient.start() called twice")
        reg = self._run(self._register_until(deadline_s), timeout=deadline_s + 1.0)
        if reg.epoch.number:
            self.deliver(reg.epoch)
        # Made here, not inside the session coroutine, so that a close() right after start() always finds it
        # (an asyncio.Event binds to the loop that first waits on it).
        stop = self._stop = asyncio.Event()

        async def session() -> None:
            # The group's ranks (its shard count) all get the epochs: rank 0 relays them to the others.
            await self.aio.run(self.deliver, stop, step=lambda: self._step, on_lost=self._on_lost,
                               known_epoch=self._latest.number if self._latest else 0, ranks=self.aio.shard_count)

        self._session = asyncio.run_coroutine_threadsafe(session(), self._loop)
        return reg

    async def _register_until(self, deadline_s: float) -> Registration:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        backoff = Backoff()
        while True:
            try:
                return await self.aio.register()
            except LighthouseUnavailable:
                if loop.time() + backoff.current > end:
                    raise
                await asyncio.sleep(backoff.next())  # retry pacing, bounded by the deadline

    def set_step(self, step: int) -> None:
        """Reported with the next heartbeat (informational)."""
        self._step = step

    def set_digest(self, step: int, digest: str) -> None:
        """The replica's state digest (hex) before ``step``, reported with the next heartbeats (informational: the
        lighthouse's status shows whether the replicas agree)."""
        self.aio.digest = (step, digest)

    def set_pace(self, pace: Pace) -> None:
        """The replica's pace (medians of compute and exchange wait over its last steps), reported with the next
        heartbeats (fail-slow evidence: ``lighthouse.stragglers``)."""
        self.aio.pace = pace

    @property
    def epoch(self) -> EpochView | None:
        with self._cond:
            return self._latest

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        """Wait until an epoch numbered above ``after`` is known; None at the deadline."""
        with self._cond:
            self._cond.wait_for(lambda: self._latest is not None and self._latest.number > after, timeout)
            return self._latest if self._latest is not None and self._latest.number > after else None

    def report_failure(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> ReportResult:
        return self._run(self.aio.report_failure(suspect, epoch, reason, early=early))

    def ready(self, role: str, probe_s: float = 0.0) -> int:
        """Ready(``role``); JOINING with the seconds of a probe step (0: none): ``HeldOut`` while too slow."""
        return self._run(self.aio.ready(role, probe_s))

    def leave(self, reason: str = "") -> int:
        """Leave the job gracefully, with the last step given to ``set_step``."""
        return self._run(self.aio.leave(reason, self._step))

    def status(self) -> pb.StatusResponse:
        return self._run(self.aio.status())

    def close(self, leave: str | None = None) -> None:
        """Stop the session and the loop thread (idempotent). With ``leave``, leave the job gracefully with that
        reason once heartbeats have stopped (so the session cannot register again behind our back), and the last
        step given to ``set_step``."""
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._session is not None:
            with contextlib.suppress(Exception):  # the session's own failure is not ours to raise here
                self._session.result(timeout=5)
        if leave is not None:
            try:
                self._run(self.aio.leave(leave, self._step))
            except LighthouseError as e:
                log.info("replica=%s leave not acknowledged: %s", self.replica_id, e)
        with contextlib.suppress(LighthouseError):
            self._run(self.aio.close(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
