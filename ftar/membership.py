"""What FTAR needs from membership (docs/design.md §4, §5): the current epoch, a way to wait for the next, failure
reports, and a push notification when the epoch changes (to abandon an in-flight collective at once).

``Membership`` is the interface the lane engine depends on; ``LighthouseMembership`` implements it over a
``LighthouseClient``, with an ``EpochFeed`` fanning the client's pushed epochs out to the engines' listeners, and
the member's lane store (``ftar.lane_hosting``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from ftar.lane_hosting import LaneHosting
from ftar.store import StoreTarget
from lighthouse.client import LighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.errors import LighthouseError

log = logging.getLogger("fthsdp.ftar")


class Membership(Protocol):
    """The membership a ``LaneEngine`` runs under. Every method is called from the engine's own threads and must
    be thread-safe; none may block longer than asked."""

    replica_id: str
    """This replica, as the epochs name it."""

    def current(self) -> EpochView | None:
        """The newest epoch known, or ``None`` before the first; never blocks."""
        ...

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        """The first known epoch numbered above ``after``, waiting up to ``timeout`` seconds; ``None`` if none
        came."""
        ...

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        """Report ``suspect`` as failed in ``epoch`` (blame); a report the lighthouse refuses is not an error.
        ``early``: sent before the blame grace ended, acted on only with evidence (``ftar.blame``)."""
        ...

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        """Call ``fn`` on every new epoch; returns a function that removes it."""
        ...


class EpochFeed:
    """Fans pushed epochs out to listeners; plug ``publish`` into ``LighthouseClient(on_epoch=...)``. It keeps the
    newest one published (``current``): a process's one place to read its epoch."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[EpochView], None]] = []
        self._lock = threading.Lock()
        self._published = threading.Condition(self._lock)
        self._latest: EpochView | None = None

    def publish(self, epoch: EpochView) -> None:
        with self._lock:
            if self._latest is None or epoch.number > self._latest.number:
                self._latest = epoch
                self._published.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn(epoch)

    def current(self) -> EpochView | None:
        """The newest epoch published, or ``None`` before the first; never blocks."""
        with self._lock:
            return self._latest

    def wait_until(self, ready: Callable[[EpochView | None], bool], timeout: float) -> EpochView | None:
        """The newest epoch once ``ready`` holds for it, waiting up to ``timeout`` seconds for newer ones; at the
        deadline the newest, whatever it is."""
        with self._published:
            self._published.wait_for(lambda: ready(self._latest), max(0.0, timeout))
            return self._latest

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

    def __init__(self, client: LighthouseClient, feed: EpochFeed, *, key: str = "", host: str = "127.0.0.1") -> None:
        self.client = client
        self.feed = feed
        self.replica_id = client.replica_id
        self.hosting = LaneHosting(client.replica_id, client.aio.job_id, key, host, feed.current)
        """This member's side of member-hosted lane rendezvous: its lane store on ``host`` (requests signed with
        ``key``, the job's catch-up key; without one, loopback only) and its lanes' hosts."""

    def current(self) -> EpochView | None:
        return self.client.epoch

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        return self.client.wait_epoch(after, timeout)

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        try:
            result = self.client.report_failure(suspect, epoch, reason, early=early)
            log.info("ftar replica=%s epoch=%d blamed %s%s: %s", self.replica_id, epoch, suspect,
                     " early" if early else "", result.detail)
        except LighthouseError as e:  # stale epoch etc.: the lighthouse already moved on
            log.info("ftar replica=%s epoch=%d report on %s not taken: %s", self.replica_id, epoch, suspect, e)

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        return self.feed.add_listener(fn)

    def close(self) -> None:
        """Stop this member's lane store."""
        self.hosting.close()

    def store_target(self) -> StoreTarget:
        """Where the data plane's rendezvous store is (the lighthouse this client talks to now, the leader
        after a redirect) and the credentials for it (the client's own TLS and job token)."""
        aio = self.client.aio
        return StoreTarget(aio.address, aio.security, aio.job_id)
