"""What FTAR needs from membership: the current epoch, a way to wait for the next, failure reports, and a
push notification when the epoch changes (to abandon an in-flight collective at once)."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from lighthouse.client import LighthouseClient
from lighthouse.errors import LighthouseError
from lighthouse.wire import EpochView

log = logging.getLogger("fthsdp.ftar")


class Membership(Protocol):
    replica_id: str

    def current(self) -> EpochView | None: ...

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None: ...

    def report(self, suspect: str, epoch: int, reason: str) -> None: ...

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        """Call ``fn`` on every new epoch; returns a function that removes it."""
        ...


class EpochFeed:
    """Fans pushed epochs out to listeners; plug ``publish`` into ``LighthouseClient(on_epoch=...)``."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[EpochView], None]] = []
        self._lock = threading.Lock()

    def publish(self, epoch: EpochView) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(epoch)

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(fn)

        def remove() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
        return remove


class LighthouseMembership:
    """``Membership`` backed by a ``LighthouseClient`` whose ``on_epoch`` is ``feed.publish``."""

    def __init__(self, client: LighthouseClient, feed: EpochFeed) -> None:
        self.client = client
        self.feed = feed
        self.replica_id = client.replica_id

    def current(self) -> EpochView | None:
        return self.client.epoch

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        return self.client.wait_epoch(after, timeout)

    def report(self, suspect: str, epoch: int, reason: str) -> None:
        try:
            result = self.client.report_failure(suspect, epoch, reason)
            log.info("ftar replica=%s epoch=%d blamed %s: %s", self.replica_id, epoch, suspect, result.detail)
        except LighthouseError as e:  # stale epoch etc.: the lighthouse already moved on
            log.info("ftar replica=%s epoch=%d report on %s not taken: %s", self.replica_id, epoch, suspect, e)

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        return self.feed.add_listener(fn)
