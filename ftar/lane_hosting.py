"""A member's side of member-hosted lane rendezvous (docs/design.md §5, "Lanes at scale"; the rules:
``lighthouse.lane_hosts``): where a lane's epoch group meets, the store this member serves when it hosts a lane,
and, per lane, the addresses of the members likely to host it next.

At every rendezvous, whatever its mode, each of the lane's ``CANDIDATES`` announces its store's address on the
lane's store (``host/<replica>``) before it arrives, and once the group's first collective completed every member
reads those it lacks (at most ``CANDIDATES - 1`` reads, none blocking: every member had arrived). After a death the
next host is one of them, so the members meet on it without asking anyone (``MEMBERS``). A member that does not
know the host (a joiner, a new incarnation) reads its address on the lighthouse, where the host sets it
(``ANNOUNCED``); one that should know it and does not fails its rendezvous, and the re-formed epoch that follows
meets on the lighthouse (``LIGHTHOUSE``). A lane of many members meeting on kept addresses meets on the first
``SPREAD`` of them at once (``lane_hosts.stores``, ``ftar.spread_store``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftar.errors import Abandoned
from ftar.lane_store import LaneStoreServer, MemberStore
from ftar.spread_store import SpreadStore
from ftar.store import StoreRefused, StoreTarget, StoreTimeout, open_store
from lighthouse import lane_hosts
from lighthouse.epoch_view import EpochView
from lighthouse.rendezvous import SCHEME, hosting_of

log = logging.getLogger("fthsdp.ftar")

HOST_KEY = "host"
"""Lane-store key prefix a candidate sets (``host/<replica>``) to its store's address."""
LOOKUP_POLL_S = 0.25
"""How long one wait for a host's address on the lighthouse lasts before the epoch is looked at again."""

Target = StoreTarget | Callable[[], StoreTarget] | None


def member_hosted(epoch: EpochView) -> bool:
    """Whether ``epoch``'s lanes meet on their members' stores."""
    hosting = hosting_of(epoch.rendezvous)
    return hosting is not None and hosting[0] != lane_hosts.LIGHTHOUSE


class LaneHosting:
    """One member's lane store (started at its first rendezvous) and what it knows of its lanes' hosts."""

    def __init__(self, replica_id: str, job_id: str, key: str, host: str,
                 epoch: Callable[[], EpochView | None]) -> None:
        self.replica_id = replica_id
        self.job_id = job_id
        self._key = key
        self._host = host
        self._epoch = epoch
        self._server: LaneStoreServer | None = None
        self._known: dict[tuple[int, str], tuple[str, str]] = {}
        """(lane, replica id) -> (its incarnation, its store's address)."""
        self._lock = threading.Lock()

    def address(self) -> str:
        """This member's lane store (started on first use)."""
        with self._lock:
            if self._server is None:
                self._server = LaneStoreServer(self.job_id, self._key, self._host, self._epoch)
                log.info("ftar replica=%s lane store serving at %s", self.replica_id, self._server.address)
            return self._server.address

    def known(self, lane: int, replica_id: str, incarnation: str) -> str | None:
        """The address this member keeps for ``replica_id``'s store (that incarnation's), if any."""
        with self._lock:
            entry = self._known.get((lane, replica_id))
        return entry[1] if entry is not None and entry[0] == incarnation else None

    def open(self, epoch: EpochView, lane: int, lighthouse: Target, timeout: timedelta,
             superseded: Callable[[], bool]) -> tuple[Any, str]:
        """The store ``lane`` meets on in member-hosted ``epoch`` and the replica hosting it: the host's store, or
        the lane's stores as one (``SpreadStore``, ``lane_hosts.stores``). Raises ``StoreRefused`` when this member
        does not know a store's address and nobody can tell it, ``Abandoned`` once ``superseded()`` while it waits
        for the host's announcement."""
        hosting = hosting_of(epoch.rendezvous)
        assert hosting is not None
        mode, namespace = hosting
        on = lane_hosts.stores(epoch.members, lane, mode, epoch.spread_from)  # the lighthouse's: one for the job
        if not on:
            raise StoreRefused(f"epoch {epoch.number} has no member to host lane {lane}")
        addresses = [self._address_of(epoch, lane, rid, mode, namespace, lighthouse, timeout, superseded,
                                      "the host" if i == 0 else "a store")
                     for i, rid in enumerate(on)]
        stores = [MemberStore(a, self._key, self.job_id, namespace, timeout) for a in addresses]
        if len(stores) == 1:
            return stores[0], on[0]
        return SpreadStore(stores, epoch.replica_ids.index(self.replica_id) % len(stores)), on[0]

    def _address_of(self, epoch: EpochView, lane: int, rid: str, mode: str, namespace: str, lighthouse: Target,
                    timeout: timedelta, superseded: Callable[[], bool], what: str) -> str:
        """The address of ``rid``'s store, one ``lane`` meets on: this member's own (announced on the lighthouse
        when the mode says so), one it kept, or the one its host announced."""
        member = epoch.member(rid)
        if member is None:
            raise StoreRefused(f"epoch {epoch.number}: {rid}, {what} of lane {lane}, is not a member")
        if rid == self.replica_id:
            address = self.address()
            if mode == lane_hosts.ANNOUNCED:
                open_store(SCHEME + namespace, lighthouse, timeout).set(f"lane{lane}/{HOST_KEY}", address)
            return address
        address = self.known(lane, rid, member.incarnation) or ""
        if not address and mode == lane_hosts.ANNOUNCED:
            address = self._look_up(SCHEME + namespace, lane, lighthouse, timeout, superseded)
        if not address:
            raise StoreRefused(f"epoch {epoch.number}: no address known for {rid}, {what} of lane {lane}")
        return address

    def _look_up(self, rendezvous: str, lane: int, lighthouse: Target, timeout: timedelta,
                 superseded: Callable[[], bool]) -> str:
        """The host's address as it set it on the lighthouse, waiting up to ``timeout``."""
        store = open_store(rendezvous, lighthouse, timedelta(seconds=LOOKUP_POLL_S))
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                return bytes(store.get(f"lane{lane}/{HOST_KEY}")).decode()
            except StoreTimeout:
                if superseded():
                    raise Abandoned() from None
                if time.monotonic() >= deadline:
                    raise

    def announce(self, epoch: EpochView, lane: int, store: Any) -> None:
        """Set this member's address on the lane's ``store`` if it is one of the lane's candidates."""
        if self.replica_id in lane_hosts.candidates(epoch.replica_ids, lane):
            store.set(f"{HOST_KEY}/{self.replica_id}", self.address())

    def unknown(self, epoch: EpochView, lane: int) -> list[str]:
        """The lane's other candidates in ``epoch`` whose addresses (these incarnations') this member lacks."""
        out = []
        for rid in lane_hosts.candidates(epoch.replica_ids, lane):
            member = epoch.member(rid)
            if rid != self.replica_id and member is not None and self.known(lane, rid, member.incarnation) is None:
                out.append(rid)
        return out

    def learn(self, epoch: EpochView, lane: int, store: Any) -> None:
        """Keep the addresses the lane's other candidates announced on ``store`` (those this member lacks, and that
        did announce: no wait), and forget those of the lane's former members."""
        found: dict[tuple[int, str], tuple[str, str]] = {}
        for rid in self.unknown(epoch, lane):
            key = f"{HOST_KEY}/{rid}"
            member = epoch.member(rid)
            if member is not None and store.check([key]):
                found[(lane, rid)] = (member.incarnation, bytes(store.get(key)).decode())
        with self._lock:
            for k in [k for k in self._known if k[0] == lane and epoch.member(k[1]) is None]:
                del self._known[k]
            self._known.update(found)

    def close(self) -> None:
        """Stop the lane store."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
