"""A replica's background session with the lighthouse (``AsyncLighthouseClient``, used directly by the emulator to
drive thousands of replicas from one process): it keeps one session stream open, heartbeats up and epochs down as
deltas (with an older lighthouse: unary heartbeats beside a watch stream), reconnecting with jittered exponential
backoff and rotating through the lighthouse addresses; retries a failed Ready(ACTIVE); and tells the two ways of
being unknown apart:

- FAILED_PRECONDITION: this incarnation is over (declared dead, e.g. while it hung; left; or replaced). It never
  registers again (that would put a replica whose state fell behind back into the job): ``on_lost`` is told at
  once and heartbeats stop; the runtime restarts as a new incarnation.
- NOT_FOUND: the lighthouse does not know it at all (it restarted without its state). The same incarnation
  registers again with the role it holds and the newest epoch it saw, and the lighthouse relearns the membership
  from those re-registrations: nobody restarts. Only if the lighthouse does not give that role back (it had
  formed an epoch without this replica), or if this incarnation had already seen an epoch drop it, is
  ``on_lost`` told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from lighthouse.backoff import Backoff
from lighthouse.client_streams import LighthouseStreams
from lighthouse.epoch_view import EpochView
from lighthouse.errors import (
    FencedOut,
    InvalidRequest,
    LighthouseError,
    SessionsUnsupported,
    Unauthenticated,
    UnknownTarget,
)
from lighthouse.model import ACTIVE, JOINING

log = logging.getLogger("fthsdp.lighthouse.client")


class AsyncLighthouseClient(LighthouseStreams):
    """One replica's view of the lighthouse, on the caller's event loop: the calls, and ``run`` for the
    background session."""

    async def run(self, on_epoch: Callable[[EpochView], None], stop: asyncio.Event, *,
                  step: Callable[[], int] = lambda: 0, on_lost: Callable[[str], None] | None = None,
                  known_epoch: int = 0, ranks: int = 1) -> None:
        """Heartbeat and watch until ``stop`` is set: on one session stream (``session``), or, with a lighthouse
        that has none, with unary heartbeats beside a watch stream. ``ranks``: the group's ranks the epochs reach
        (informational, for the lighthouse; its rank 0 relays them to the others: ``fthsdp.runtime.epoch_relay``).

        ``on_lost`` is told, and heartbeats stop, when this incarnation is over (declared dead, left or replaced),
        or when a lighthouse that lost it does not give it back its role (see the module's docstring).
        """
        latest = {"n": known_epoch}
        held: list[EpochView] = []  # the newest epoch delivered: what the session's deltas apply to

        def deliver(e: EpochView) -> None:
            if e.number > latest["n"]:
                latest["n"] = e.number
                held[:] = [e]
                self.saw(e)
                on_epoch(e)

        def lost(why: str) -> None:
            log.warning("replica=%s incarnation %s is over (%s); heartbeats stop", self.replica_id,
                        self.incarnation, why)
            if on_lost is not None:
                on_lost(why)

        task = asyncio.create_task(self._session_loop(deliver, latest, held, step, stop, lost, ranks))
        try:
            await stop.wait()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _session_loop(self, deliver: Callable[[EpochView], None], latest: dict[str, int],
                            held: list[EpochView], step: Callable[[], int], stop: asyncio.Event,
                            lost: Callable[[str], None], ranks: int) -> None:
        backoff = Backoff()
        while not stop.is_set():
            try:
                async for e in self.session(held[0] if held else None, lambda: (step(), latest["n"]),
                                            lambda: self.heartbeat_interval_s, ranks, self._retry_if_pending):
                    backoff.reset()
                    deliver(e)
            except SessionsUnsupported as e:
                log.info("replica=%s: %s; heartbeating and watching apart", self.replica_id, e)
                await asyncio.gather(self._watch_loop(deliver, latest, stop),
                                     self._heartbeat_loop(step, latest, stop, lost, deliver))
                return
            except (FencedOut, UnknownTarget) as e:
                if (why := await self._over(e, latest, deliver)) is not None:
                    lost(why)
                    return
            except LighthouseError as e:
                (log.warning if isinstance(e, Unauthenticated) else log.debug)(
                    "session replica=%s broke: %s", self.replica_id, e)
            await backoff.wait(stop)

    async def _retry_if_pending(self) -> None:
        if self.active_pending:
            await self._retry_ready_active()

    async def _over(self, e: FencedOut | UnknownTarget, latest: dict[str, int],
                    deliver: Callable[[EpochView], None]) -> str | None:
        """Why this incarnation is over, if it is (None: go on). FencedOut: declared dead (its state may have fallen
        behind), left, or replaced by a newer incarnation; registering it again would bring back a stale replica,
        or evict the newer one. UnknownTarget: the lighthouse restarted without its state; it is registered again
        with the role it holds (a failed attempt is retried by the caller's next round)."""
        if isinstance(e, FencedOut):
            return str(e)
        if self.dropped_from:
            # Dropped (declared dead while it hung or was cut off) by a lighthouse that has since lost its state:
            # its role is not its own to claim back, and its state may have fallen behind.
            return f"dropped from epoch {self.dropped_from}, then unknown to a restarted lighthouse ({e})"
        claim = self.held_role
        log.warning("replica=%s unknown to the lighthouse (%s): registering incarnation %s again as %s",
                    self.replica_id, e, self.incarnation, claim or "joining (not in the data plane)")
        try:
            reg = await self.register(claim, latest["n"])
        except (FencedOut, InvalidRequest) as e2:
            return f"registering again was refused: {e2}"
        except LighthouseError as e2:
            log.warning("replica=%s re-register failed: %s", self.replica_id, e2)
            return None
        if reg.role != (claim or JOINING):
            return (f"the lighthouse lost this replica and gave it back as {reg.role}, not {claim or JOINING}: "
                    "it formed an epoch without it")
        deliver(reg.epoch)
        return None

    async def _watch_loop(self, deliver: Callable[[EpochView], None], latest: dict[str, int],
                          stop: asyncio.Event) -> None:
        backoff = Backoff()
        while not stop.is_set():
            try:
                async for e in self.watch(after_epoch=latest["n"]):
                    backoff.reset()
                    deliver(e)
            except LighthouseError as e:
                log.debug("watch replica=%s broke: %s", self.replica_id, e)
            await backoff.wait(stop)

    async def _heartbeat_loop(self, step: Callable[[], int], latest: dict[str, int], stop: asyncio.Event,
                              lost: Callable[[str], None], deliver: Callable[[EpochView], None]) -> None:
        """Unary heartbeats, for a lighthouse without sessions."""
        backoff = Backoff()
        while not stop.is_set():
            try:
                await self.heartbeat(step(), latest["n"])
                backoff.reset()
                wait = self.heartbeat_interval_s
                if self.active_pending:
                    await self._retry_ready_active()
            except (FencedOut, UnknownTarget) as e:
                if (why := await self._over(e, latest, deliver)) is not None:
                    lost(why)
                    return
                wait = self.heartbeat_interval_s
            except LighthouseError as e:
                (log.warning if isinstance(e, Unauthenticated) else log.debug)(
                    "heartbeat replica=%s failed: %s", self.replica_id, e)
                wait = backoff.next()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _retry_ready_active(self) -> None:
        """Retry a Ready(ACTIVE) that failed (paced by the heartbeats), so that a replica is never left joining
        for good: until the lighthouse takes it, or refuses it for good (then its join deadline drops it)."""
        try:
            await self.ready(ACTIVE)
            log.info("replica=%s Ready(active) went through on a retry", self.replica_id)
        except (FencedOut, InvalidRequest) as e:
            self.active_wanted = False
            log.error("replica=%s Ready(active) refused: %s", self.replica_id, e)
        except LighthouseError as e:
            log.info("replica=%s Ready(active) failed again (%s); retrying", self.replica_id, e)
