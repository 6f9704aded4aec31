"""Where the lighthouse keeps durable job state, behind one interface.

Only what must survive a lighthouse restart is stored: the highest epoch number issued (so numbers are never
reused), the current epoch and registrations, and the epoch history. Heartbeat times are not stored.

Every write is fenced: ``save`` names the ``last_number`` it read, and fails with ``EpochFenced`` if the stored
one differs (another lighthouse wrote first). The etcd implementation maps that onto a transaction comparing
the key's value; the in-memory one compares under a lock. Both pass ``tests/test_store_conformance.py``.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from typing import Any

from lighthouse.errors import EpochFenced


class Store(ABC):
    """Durable state of lighthouse jobs, as JSON documents fenced by epoch number."""

    @abstractmethod
    def load(self, job_id: str) -> dict[str, Any] | None:
        """The job's stored document, or None when nothing was stored yet."""

    @abstractmethod
    def save(self, job_id: str, expected_last_number: int, document: dict[str, Any]) -> None:
        """Replace the job's document if its stored ``last_number`` equals ``expected_last_number``.

        ``document['last_number']`` must not be lower than the expected one (numbers only go up).
        Raises ``EpochFenced`` otherwise; nothing is written then.
        """

    def close(self) -> None:
        """Release connections."""


def check_monotonic(expected_last_number: int, document: dict[str, Any]) -> None:
    if int(document["last_number"]) < expected_last_number:
        raise EpochFenced(f"epoch number would go back: {document['last_number']} < {expected_last_number}")


class InMemoryStore(Store):
    """The embedded default: state lives as long as the lighthouse process."""

    def __init__(self) -> None:
        self._docs: dict[str, bytes] = {}
        self._numbers: dict[str, int] = {}
        self._lock = threading.Lock()

    def load(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            raw = self._docs.get(job_id)
        return None if raw is None else json.loads(raw)

    def save(self, job_id: str, expected_last_number: int, document: dict[str, Any]) -> None:
        check_monotonic(expected_last_number, document)
        raw = json.dumps(document, sort_keys=True).encode()
        with self._lock:
            stored = self._numbers.get(job_id, 0)
            if stored != expected_last_number:
                raise EpochFenced(f"job {job_id}: stored epoch {stored}, writer expected {expected_last_number}")
            self._docs[job_id] = raw
            self._numbers[job_id] = int(document["last_number"])


def open_store(url: str) -> Store:
    """``memory://`` (the embedded default) or ``etcd://host:port[,host:port...][/prefix]``."""
    if url in ("", "memory", "memory://"):
        return InMemoryStore()
    if url.startswith("etcd://"):
        from lighthouse.store_etcd import EtcdStore  # imported here: the embedded default needs no etcd client

        return EtcdStore(url)
    raise ValueError(f"unsupported store {url!r}: want memory:// or etcd://host:port[,host:port...][/prefix]")
