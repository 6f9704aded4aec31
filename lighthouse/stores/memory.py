"""The in-memory store: the embedded default, state lives as long as the lighthouse process."""

from __future__ import annotations

import json
import threading
from typing import Any

from lighthouse.errors import EpochFenced
from lighthouse.stores.base import Capabilities, Store, check_monotonic


class InMemoryStore(Store):
    """Job documents in this process, fenced under a lock (stored as JSON, so a load returns a copy)."""

    capabilities = Capabilities(election=False, in_process=True)

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

    def close(self) -> None:
        """Nothing to release: the documents live as long as the store object."""
