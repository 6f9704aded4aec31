"""Leader election of lighthouses sharing one etcd store.

The leader is whoever created ``{prefix}/leader`` bound to its lease (an etcd transaction comparing the key's
create revision with 0, the recipe etcd's own election and pyetcd's ``Lock`` use). The leader keeps its lease
alive; if it dies, the lease expires after ``ttl_s`` and the key goes with it, and the next candidate to try
creates it. Leases alone do not give mutual exclusion (a paused leader may believe it still leads), so the
store also fences every write on this key's value (``EtcdStore.set_guard``): a deposed leader cannot write.

Runs on its own thread (pyetcd is blocking) and reports changes through ``on_change(leading, leader_address)``.
Every etcd call fails over to the other etcd members before it counts as an error (``failing_over``): one dead
member neither makes a follower lose sight of the leader nor costs a leader a renewal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lighthouse.errors import StoreUnavailable
from lighthouse.stores.base import Election
from lighthouse.stores.etcd_client import ETCD_ERRORS, failing_over

log = logging.getLogger("fthsdp.lighthouse.election")


@dataclass(frozen=True)
class LeaderInfo:
    """What the leader key holds: where the leader serves gRPC and HTTP."""

    address: str
    http: str = ""
    candidate_id: str = ""

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "http": self.http, "id": self.candidate_id},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> LeaderInfo | None:
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(str(d["address"]), str(d.get("http", "")), str(d.get("id", "")))
        except (ValueError, KeyError, TypeError):
            return None


class EtcdElection(Election):
    """Campaign for, hold and give up the leader key ``key`` through the pyetcd ``client``. On winning it calls
    ``set_guard(key, value)``, which fences the store's writes on still holding the key."""

    def __init__(self, client: Any, key: str, set_guard: Callable[[str, bytes], None], address: str, http: str,
                 on_change: Callable[[bool, str], None], ttl_s: int = 5) -> None:
        if ttl_s < 2:
            raise ValueError("election ttl_s must be at least 2 (etcd rounds shorter leases up)")
        self.client = client
        self.key = key
        self._set_guard = set_guard
        self.me = LeaderInfo(address, http, uuid.uuid4().hex)
        self._mine = self.me.encode()
        self.ttl_s = ttl_s
        self.period_s = ttl_s / 4
        self._on_change = on_change
        self._stop = threading.Event()
        self._lease: Any = None
        self._leading = False
        self._leader = ""
        self._last_renewed = 0.0
        self._thread = threading.Thread(target=self._run, name="lighthouse-election", daemon=True)

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def leader(self) -> str:
        """The leader's gRPC address as last seen ('' when none is known)."""
        return self._leader

    def first_round(self) -> None:
        """One campaign, on the caller's thread (before ``start``), so the outcome is known at once."""
        self._round()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so that a successor takes over at once."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)
        if self._lease is not None:
            try:
                self._lease.revoke()
            except ETCD_ERRORS as e:
                log.info("election: revoking the lease failed (it will expire): %r", e)
            self._lease = None
        self._set(False, "")

    # --- the loop ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # a period, not synchronisation
            self._round()

    def _round(self) -> None:
        """Campaign when following; renew the lease when leading."""
        try:
            if self._leading:
                self._renew()
            else:
                self._campaign()
        except (StoreUnavailable, *ETCD_ERRORS) as e:
            log.warning("election: etcd unreachable: %r", e)
            if self._leading and time.monotonic() - self._last_renewed > self.ttl_s:
                # Our lease has surely expired by now: someone else may lead.
                self._step_down("etcd unreachable for longer than the lease")
            elif not self._leading:
                self._set(False, "")
        except Exception:  # a bug here must not end the election for good
            log.exception("election: unexpected error")

    def _campaign(self) -> None:
        tx = self.client.transactions
        lease = failing_over(self.client, "election lease", lambda: self.client.lease(self.ttl_s))
        ok, responses = failing_over(self.client, "election campaign", lambda: self.client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self._mine, lease=lease)],
            failure=[tx.get(self.key)]))
        got = responses[0] if not ok else None
        holder = LeaderInfo.decode(got[0][0] if got else None)
        if holder is not None and holder.candidate_id == self.me.candidate_id:
            ok = True  # an attempt whose answer was lost did create the key, bound to this very lease
        if ok:
            self._lease = lease
            self._last_renewed = time.monotonic()
            self._set_guard(self.key, self._mine)
            log.info("election: this lighthouse (%s) leads", self.me.address)
            self._set(True, self.me.address)
            return
        with contextlib.suppress(*ETCD_ERRORS):  # it expires on its own
            lease.revoke()
        self._set(False, holder.address if holder else "")

    def _renew(self) -> None:
        replies = failing_over(self.client, "lease renewal", self._lease.refresh)
        ttl = replies[0].TTL if replies else 0
        if ttl <= 0:
            self._step_down("lease expired")
            return
        raw, _ = failing_over(self.client, "leader key read", lambda: self.client.get(self.key))
        if raw != self._mine:
            self._step_down("the leader key is no longer ours")
            return
        self._last_renewed = time.monotonic()

    def _step_down(self, why: str) -> None:
        log.warning("election: this lighthouse (%s) no longer leads: %s", self.me.address, why)
        self._lease = None
        self._set(False, "")

    def _set(self, leading: bool, leader: str) -> None:
        if (leading, leader) == (self._leading, self._leader):
            return
        self._leading, self._leader = leading, leader
        try:
            self._on_change(leading, leader)
        except Exception:
            log.exception("election: on_change failed")
