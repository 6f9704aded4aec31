"""A replica's background session with the lighthouse (``AsyncLighthouseClient``, used directly by the emulator to
drive thousands of replicas from one process): it heartbeats, keeps a watch stream open (reconnecting with
jittered exponential backoff, rotating through the lighthouse addresses), and re-registers if the lighthouse
lost or dropped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from lighthouse.backoff import Backoff
from lighthouse.client_rpc import LighthouseRpc
from lighthouse.epoch_view import EpochView
from lighthouse.errors import FencedOut, LighthouseError, Unauthenticated, UnknownTarget

log = logging.getLogger("fthsdp.lighthouse.client")


class AsyncLighthouseClient(LighthouseRpc):
    """One replica's view of the lighthouse, on the caller's event loop: the calls, and ``run`` for the
    background session."""

    async def run(self, on_epoch: Callable[[EpochView], None], stop: asyncio.Event, *,
                  register: bool = True, step: Callable[[], int] = lambda: 0,
                  on_lost: Callable[[str], None] | None = None, known_epoch: int = 0) -> None:
        """Heartbeat and watch until ``stop`` is set. ``register=False`` only watches (non-leader ranks).

        ``on_lost`` is told when the lighthouse no longer knows this incarnation (declared dead); the session
        then registers again as a new member. When a newer incarnation of the same replica id replaced this one,
        ``on_lost`` is told too and heartbeats stop (this process is superseded).
        """
        latest = {"n": known_epoch}

        def deliver(e: EpochView) -> None:
            if e.number > latest["n"]:
                latest["n"] = e.number
                on_epoch(e)

        tasks = [asyncio.create_task(self._watch_loop(deliver, latest, stop))]
        if register:
            tasks.append(asyncio.create_task(self._heartbeat_loop(step, latest, stop, on_lost, deliver)))
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
                              on_lost: Callable[[str], None] | None, deliver: Callable[[EpochView], None]) -> None:
        backoff = Backoff()
        while not stop.is_set():
            try:
                await self.heartbeat(step(), latest["n"])
                backoff.reset()
                wait = self.heartbeat_interval_s
            except FencedOut as e:
                # A newer incarnation of this replica registered: this process is superseded. Registering
                # again would declare the newer one dead, and the two would evict each other forever.
                log.warning("replica=%s incarnation %s was replaced (%s); heartbeats stop", self.replica_id,
                            self.incarnation, e)
                if on_lost is not None:
                    on_lost(str(e))
                return
            except UnknownTarget as e:
                log.warning("replica=%s lost its registration (%s); registering again", self.replica_id, e)
                if on_lost is not None:
                    on_lost(str(e))
                try:
                    reg = await self.register()
                    deliver(reg.epoch)
                    wait = self.heartbeat_interval_s
                except LighthouseError as e2:
                    log.warning("replica=%s re-register failed: %s", self.replica_id, e2)
                    wait = backoff.next()
            except LighthouseError as e:
                (log.warning if isinstance(e, Unauthenticated) else log.debug)(
                    "heartbeat replica=%s failed: %s", self.replica_id, e)
                wait = backoff.next()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
