"""Leader election of lighthouses sharing one etcd store.

The leader is whoever created ``{prefix}/leader`` bound to its lease (an etcd transaction comparing the key's
create revision with 0, the recipe etcd's own election and pyetcd's ``Lock`` use). The leader keeps its lease
alive; if it dies, the lease expires after ``ttl_s`` and the key goes with it, and the next candidate to try
creates it. Leases alone do not give mutual exclusion (a paused leader may believe it still leads), so the
store also fences every write on this key's value (``EtcdStore.set_guard``): a deposed leader cannot write.

A follower does not always wait for the lease: every ``probe_s`` it knocks on the leader's gRPC port
(``knock``: True refused, False answered, None no evidence). A port it reached before that now refuses twice
in a row (``STRIKES``) is a leader whose process is gone (its host answered, nothing listens), so the follower
deletes the leader key if it still holds that leader's value, and campaigns at once: the failover takes a few
probes instead of a lease (``lighthouse.server.probe`` does the same for a replica's session). A timeout or no
route proves nothing (a partition, a slow host), and a leader this follower never reached is never deposed
(an ``--advertise`` it cannot connect to); both wait for the lease. Should the deposed leader live after all,
the fence above refuses its next write and its next renewal steps it down.

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

STRIKES = 2
"""Refused knocks in a row on a leader's port, reached before, that depose it (one could be a port being rebound)."""


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
                 on_change: Callable[[bool, str], None], ttl_s: int = 5, probe_s: float = 0.0,
                 knock: Callable[[str], bool | None] | None = None) -> None:
        if ttl_s < 2:
            raise ValueError("election ttl_s must be at least 2 (etcd rounds shorter leases up)")
        if probe_s < 0:
            raise ValueError(f"election probe_s must be >= 0 (0: lease expiry only), got {probe_s}")
        self.client = client
        self.key = key
        self._set_guard = set_guard
        self.me = LeaderInfo(address, http, uuid.uuid4().hex)
        self._mine = self.me.encode()
        self.ttl_s = ttl_s
        self.period_s = ttl_s / 4
        self.probe_s = probe_s if knock is not None else 0.0
        """How often a follower knocks on the leader's port (0: never; the lease alone replaces a leader)."""
        self._knock = knock
        self._holder: tuple[LeaderInfo, bytes] | None = None
        """The leader key's holder as last read by this follower, and the key's raw value."""
        self._reached = ""
        """The candidate id of the holder whose port this follower has reached (only such a one can be deposed)."""
        self._strikes = 0
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

    @property
    def leader_reached(self) -> bool:
        held = self._holder
        return not self._leading and held is not None and held[0].candidate_id == self._reached

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
        due = time.monotonic() + self.period_s
        while not self._stop.wait(self._pause(due)):  # a period, not synchronisation
            if time.monotonic() >= due or self._gone():
                self._round()
                due = time.monotonic() + self.period_s

    def _pause(self, due: float) -> float:
        """Until the next round, or the next knock while following a leader that can be knocked on."""
        left = max(0.0, due - time.monotonic())
        return min(left, self.probe_s) if self.probe_s and not self._leading and self._holder else left

    def _gone(self) -> bool:
        """Knock on the leader's port; when it is gone (``STRIKES`` refusals by a port reached before), depose it:
        delete the leader key if it still holds that leader's value. True: campaign now."""
        if self._knock is None or self._leading or self._holder is None:
            return False
        holder, raw = self._holder
        answer = self._knock(holder.address)
        if answer is False:
            self._reached, self._strikes = holder.candidate_id, 0
            return False
        if answer is None or self._reached != holder.candidate_id:
            self._strikes = 0
            return False
        self._strikes += 1
        if self._strikes < STRIKES:
            return False
        self._strikes, self._holder = 0, None
        tx = self.client.transactions
        try:
            deleted, _ = failing_over(self.client, "deposing a gone leader", lambda: self.client.transaction(
                compare=[tx.value(self.key) == raw], success=[tx.delete(self.key)], failure=[]))
        except (StoreUnavailable, *ETCD_ERRORS) as e:
            log.warning("election: could not depose the gone leader %s: %r", holder.address, e)
            return False
        log.warning("election: the leader %s refuses connections (its process is gone)%s; campaigning",
                    holder.address, "" if deleted else ", and the leader key changed meanwhile")
        return True

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
            self._lease, self._holder, self._strikes = lease, None, 0
            self._last_renewed = time.monotonic()
            self._set_guard(self.key, self._mine)
            log.info("election: this lighthouse (%s) leads", self.me.address)
            self._set(True, self.me.address)
            return
        with contextlib.suppress(*ETCD_ERRORS):  # it expires on its own
            lease.revoke()
        if holder is None or self._holder is None or self._holder[0] != holder:
            self._strikes = 0
        self._holder = (holder, got[0][0]) if holder is not None and got else None
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
