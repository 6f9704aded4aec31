"""The replica group's epochs, fanned out inside the group (docs/design.md §3): rank 0 holds the group's one
session with the lighthouse, and hands every epoch it receives to the group's other ranks through the store
torchrun already runs for the group (``MASTER_ADDR``/``MASTER_PORT``). So the lighthouse holds one stream per
replica group whatever its ranks, and no rank opens a port of its own for this.

Keys, under ``fthsdp/epochs/<replica>/<incarnation>/``: ``<k>`` is the k-th epoch rank 0 relayed (a serialized
``Epoch``; empty: rank 0 closed, followers stop; ``LOST`` and a reason: the lighthouse dropped this incarnation,
followers tell their replica and stop), ``n`` the newest k. A follower waits for the key after the last
one it took (the store wakes it when rank 0 writes it), then takes the newest: every epoch is whole, so one it
skipped matters no more than one the lighthouse itself did not push. Rank 0 deletes keys ``KEEP`` behind.

torchrun's store has no authentication (and listens on every interface), so every value rank 0 writes is sealed:
an HMAC-SHA256, under a key the group's ranks share and nobody else has (drawn by rank 0 and broadcast over the
replica's own process group: ``fthsdp.runtime.startup.group_secret``), of the value and the full key it is written
under. A follower takes only what opens: an epoch, a close or a loss written by anyone else (a forged epoch
numbered 2^63 naming an attacker's rendezvous, say) is refused and logged, and it waits for rank 0's.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftar.devices import start_thread
from ftar.membership import EpochFeed
from lighthouse.client import LighthouseClient
from lighthouse.client_rpc import Registration
from lighthouse.epoch_view import EpochView
from lighthouse.proto_codec import epoch_from_bytes, view_to_pb

log = logging.getLogger("fthsdp.runtime")

KEEP = 64
"""Relayed epochs kept in the store (a follower takes the newest; older ones only serve one that fell behind)."""
FOLLOW_WAIT_S = 3600.0
"""How long one wait of a follower lasts before it waits again (the store logs each expiry): epochs may be hours
apart, and rank 0 wakes followers when it closes."""
CONNECT_TIMEOUT_S = 60.0
LOST = b"\x00lost "
"""What a relayed key starts with when the lighthouse dropped this incarnation (a serialized epoch never does: its
first field's tag is not 0), followed by the lighthouse's reason."""
MAC_BYTES = 32
RECHECK_S = 0.1
"""How often a follower reads a key again whose value did not open (rank 0's write replaces it)."""


def seal(key: bytes, name: str, body: bytes) -> bytes:
    """``body`` as rank 0 writes it under the store key ``name``: its MAC (bound to ``name``) first."""
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest() + body


def opened(key: bytes, name: str, raw: bytes) -> bytes | None:
    """The body of ``raw`` read under ``name``, or None if rank 0 did not write it there (forged, replayed from
    another key, truncated)."""
    if len(raw) < MAC_BYTES:
        return None
    mac, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
    good = hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest()
    return body if hmac.compare_digest(mac, good) else None


def group_store(prefix: str) -> dist.Store:
    """A connection of its own to the replica group's torchrun store (not the process group's: a follower blocks in
    ``wait``, which would hold that connection's lock against the training thread), under ``prefix``."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise RuntimeError("MASTER_ADDR and MASTER_PORT must name the replica group's torchrun store (torchrun sets "
                           "them): the group's ranks other than 0 take their epochs from rank 0 through it")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                          wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


class GroupEpochs:
    """The lighthouse's epochs on every rank of one replica group: rank 0 registers and holds the session, and
    relays each epoch to the others; the others follow (``client.deliver``) and never open a stream of their own.
    Their ``client`` still makes unary calls (a failure report), which hold no stream."""

    def __init__(self, client: LighthouseClient, feed: EpochFeed, rank: int, world_size: int, *, key: bytes,
                 store: Callable[[str], dist.Store] = group_store,
                 on_lost: Callable[[str], None] | None = None) -> None:
        if len(key) < 16:
            raise ValueError("the relay key must be a secret of at least 16 bytes (startup.group_secret)")
        self.client, self.feed, self.rank, self._key = client, feed, rank, key
        self.on_lost = on_lost
        """A follower's: called when rank 0 relays that the lighthouse dropped this incarnation (``lost``)."""
        self._lost: str | None = None
        self._prefix = prefix = f"fthsdp/epochs/{client.replica_id}/{client.incarnation}/"
        self._connect: Callable[[], dist.Store] = functools.partial(store, prefix)
        self._store = self._connect() if world_size > 1 else None
        self._cond = threading.Condition()
        self._latest: EpochView | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next = 1
        """The key a follower waits for."""
        self._refused: dict[str, bytes] = {}
        """Values refused, by key (each logged once)."""

    def start(self, wait_s: float) -> Registration | None:
        """Rank 0: register (retrying up to ``wait_s``) and start the session, relaying its epochs; the others:
        follow rank 0. Returns rank 0's registration."""
        if self._store is None:
            return self.client.start(deadline_s=wait_s)
        if self.rank != 0:
            self._thread = start_thread(self._follow, name="fthsdp-epoch-follower", device=None)
            return None
        self.feed.add_listener(self._offer)
        self._thread = start_thread(self._relay, name="fthsdp-epoch-relay", device=None)
        return self.client.start(deadline_s=wait_s)

    def _offer(self, epoch: EpochView) -> None:
        """Rank 0, on the lighthouse client's thread: hand ``epoch`` to the relay thread (never blocks on the store)."""
        with self._cond:
            self._latest = epoch
            self._cond.notify()

    def lost(self, reason: str) -> None:
        """Rank 0: the lighthouse dropped this incarnation (``LighthouseClient``'s ``on_lost``). Tell the followers,
        whose exchanges would otherwise wait for epochs that never come (a joiner back as the job ends). A no-op on
        a follower and in a one-rank group: nobody to tell."""
        if self.rank != 0 or self._store is None:
            return
        with self._cond:
            self._lost = reason
            self._cond.notify()

    def _relay(self) -> None:
        assert self._store is not None
        k, sent = 0, 0

        def due() -> bool:
            return self._closed or self._lost is not None or (self._latest is not None and self._latest.number > sent)

        while True:
            with self._cond:
                self._cond.wait_for(due)
                epoch, closed, lost = self._latest, self._closed, self._lost
            try:
                k += 1
                if closed or lost is not None:  # rank 0 is done, or this incarnation is
                    self._put(str(k), b"" if lost is None else LOST + lost.encode())
                    self._put("n", str(k).encode())
                    return
                assert epoch is not None
                sent = epoch.number
                self._put(str(k), view_to_pb(epoch).SerializeToString())
                self._put("n", str(k).encode())
                if k > KEEP:
                    self._store.delete_key(str(k - KEEP))
            except dist.DistError as e:  # the group's store is gone: the group is going down
                log.warning("fthsdp replica=%s rank=0 epoch=%d: cannot relay epochs to the group's ranks: %s",
                            self.client.replica_id, sent, e)
                return

    def _put(self, name: str, body: bytes) -> None:
        assert self._store is not None
        self._store.set(name, seal(self._key, self._prefix + name, body))  # type: ignore[arg-type]

    def _take(self, name: str) -> bytes | None:
        """Rank 0's value under ``name``; None (logged) if what is there did not come from rank 0."""
        assert self._store is not None
        raw = self._store.get(name)
        body = opened(self._key, self._prefix + name, raw)
        if body is None and self._refused.get(name) != raw:  # once per forgery, not at every re-read
            self._refused = {**self._refused, name: raw} if len(self._refused) < KEEP else {name: raw}
            log.warning("fthsdp replica=%s rank=%d: the group store's key %r holds a value rank 0 did not write "
                        "(forged?): refused", self.client.replica_id, self.rank, name)
        return body

    def _follow(self) -> None:
        assert self._store is not None
        while not self._closed:
            k = self._next
            try:
                if self._relayed() < k:  # else: behind, take the newest at once
                    self._store.wait([str(k)], timedelta(seconds=FOLLOW_WAIT_S))
                newest = max(k, self._relayed())
                raw = self._take(str(newest))
                if raw is None:  # not rank 0's: read again (rank 0's write replaces it), never take it
                    time.sleep(RECHECK_S)
                    continue
            except dist.DistError as e:
                if self._closed:
                    return
                if "timeout" in str(e):
                    continue
                log.warning("fthsdp replica=%s rank=%d: lost the epochs relayed by rank 0: %s",
                            self.client.replica_id, self.rank, e)
                return
            if not raw:
                return  # rank 0 closed
            if raw.startswith(LOST):
                if self.on_lost is not None:
                    self.on_lost(raw[len(LOST):].decode(errors="replace"))
                return
            self.client.deliver(epoch_from_bytes(raw))
            self._next = newest + 1

    def _relayed(self) -> int:
        """The newest key rank 0 relayed (0: none yet, or what is there is not rank 0's)."""
        assert self._store is not None
        body = self._take("n") if self._store.check(["n"]) else None
        return int(body) if body is not None and body.isdigit() else 0

    def close(self) -> None:
        """Stop relaying (rank 0 wakes its followers first) or following, and wait for the thread to end: a thread
        still inside the store's ``wait`` when the process exits aborts it. A follower wakes itself by writing the
        empty key it waits for, on a connection of its own (its thread's is busy waiting); the group is closing
        together, so a peer it wakes too was about to stop. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is None:
            return
        if self.rank != 0 and thread.is_alive():
            try:
                waker = self._connect()
                for _ in range(3):  # the thread may move on to the next key between the write and its wait
                    name = str(self._next)  # sealed: the thread takes it as a close
                    waker.set(name, seal(self._key, self._prefix + name, b""))  # type: ignore[arg-type]
                    thread.join(timeout=1.0)
                    if not thread.is_alive():
                        break
            except dist.DistError as e:  # the group's store is gone: nothing to wake the thread with
                log.info("fthsdp replica=%s rank=%d: cannot wake the epoch follower: %s", self.client.replica_id,
                         self.rank, e)
        thread.join(timeout=5)
