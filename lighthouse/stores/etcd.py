"""The etcd v3 store: job documents in etcd, every write a transaction fenced on the stored epoch number (and,
when this lighthouse runs an election, on its leadership key), so a deposed leader can never overwrite.

Layout under the prefix (default ``/fthsdp``)::

    {prefix}/jobs/{job_id}/number   the highest epoch number issued, as decimal text (the fence)
    {prefix}/jobs/{job_id}/state    the job document (JSON), written in the same transaction
    {prefix}/leader                 the election key (see ``lighthouse.stores.election``), bound to the leader's lease

Heartbeats are not written here (they would cost a write per replica per interval); liveness of replicas stays
in the leader's memory, and a new leader gives the restored members a grace period instead.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from lighthouse.errors import EpochFenced
from lighthouse.stores.base import Capabilities, Election, Store, check_monotonic
from lighthouse.stores.election import EtcdElection
from lighthouse.stores.etcd_client import ETCD_ERRORS, ETCD_TIMEOUT_S, EtcdTarget, connect, failing_over
from lighthouse.stores.etcd_tls import EtcdTLS

log = logging.getLogger("fthsdp.lighthouse.store")


class EtcdStore(Store):
    """Job documents in etcd. Thread-safe (pyetcd's client is); each call has a deadline. With ``tls``, every
    connection is TLS, presenting its client certificate (an etcd run with ``--client-cert-auth``)."""

    capabilities = Capabilities(election=True, in_process=False)

    def __init__(self, target: EtcdTarget | str, timeout_s: float = ETCD_TIMEOUT_S,
                 tls: EtcdTLS | None = None) -> None:
        self.target = EtcdTarget.parse(target) if isinstance(target, str) else target
        self.client = connect(self.target, timeout_s, tls)
        self._guard: tuple[str, bytes] | None = None
        self._guard_lock = threading.Lock()

    # --- keys ---------------------------------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return "/".join((self.target.prefix, *parts))

    def _keys(self, job_id: str) -> tuple[str, str]:
        return self.key("jobs", job_id, "number"), self.key("jobs", job_id, "state")

    # --- leadership fence ---------------------------------------------------------------------------------------

    def set_guard(self, key: str | None, value: bytes = b"") -> None:
        """While set, every write also requires ``key`` to hold ``value`` (this lighthouse's leadership key):
        a lighthouse that lost its lease cannot write even with a current epoch number."""
        with self._guard_lock:
            self._guard = None if key is None else (key, value)

    # --- the Store interface ------------------------------------------------------------------------------------

    def load(self, job_id: str) -> dict[str, Any] | None:
        _, state_key = self._keys(job_id)
        raw, _meta = failing_over(self.client, f"load of job {job_id!r}", lambda: self.client.get(state_key))
        return None if raw is None else json.loads(raw)

    def save(self, job_id: str, expected_last_number: int, document: dict[str, Any]) -> None:
        check_monotonic(expected_last_number, document)
        number_key, state_key = self._keys(job_id)
        raw = json.dumps(document, sort_keys=True).encode()
        new_number = str(int(document["last_number"])).encode()
        tx = self.client.transactions
        with self._guard_lock:
            guard = self._guard
        # Nothing stored reads as 0 (as in memory): a missing key has version 0; a stored "0" compares by value.
        fences = ([tx.version(number_key) == 0, tx.value(number_key) == b"0"] if expected_last_number == 0
                  else [tx.value(number_key) == str(expected_last_number).encode()])
        stored: bytes | None = None
        failures = 0
        for fence in fences:
            compare = [fence] + ([tx.value(guard[0]) == guard[1]] if guard is not None else [])

            def txn(compare: list[Any] = compare) -> tuple[bool, list[Any]]:
                nonlocal failures
                try:
                    return self.client.transaction(  # type: ignore[no-any-return]
                        compare=compare,
                        success=[tx.put(number_key, new_number), tx.put(state_key, raw)],
                        failure=[tx.get(number_key), tx.get(state_key)]
                        + ([tx.get(guard[0])] if guard is not None else []))
                except ETCD_ERRORS:
                    failures += 1
                    raise

            ok, responses = failing_over(self.client, f"save of job {job_id!r}", txn)
            if ok:
                return
            stored = responses[0][0][0] if responses[0] else None
            if failures and stored == new_number and responses[1] and responses[1][0][0] == raw:
                return  # an attempt whose answer was lost did commit: this very document is stored
            if guard is not None:
                holder = responses[2][0][0] if responses[2] else None
                if holder != guard[1]:
                    raise EpochFenced(f"job {job_id}: this lighthouse no longer leads (leader key holds "
                                      f"{holder!r}); write refused")
            if not (expected_last_number == 0 and stored == b"0"):
                break
        raise EpochFenced(f"job {job_id}: stored epoch {int(stored) if stored else 0}, writer expected "
                          f"{expected_last_number}")

    def check_access(self) -> None:
        failing_over(self.client, "access check", lambda: self.client.get(self.key("leader")))

    def election(self, address: str, http: str, on_change: Callable[[bool, str], None], ttl_s: int,
                 probe_s: float = 0.0, knock: Callable[[str], bool | None] | None = None) -> Election:
        """Leadership among the lighthouses on this prefix; while it leads, every write is fenced on it."""
        return EtcdElection(self.client, self.key("leader"), self.set_guard, address, http, on_change, ttl_s,
                            probe_s, knock)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception as e:  # closing must not mask the reason we are closing
            log.debug("etcd client close failed: %r", e)
