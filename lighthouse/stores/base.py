"""Where the lighthouse keeps durable job state: one interface, with the capabilities the server asks about.

Only what must survive a lighthouse restart is stored (``lighthouse.state_doc``): the highest epoch number issued
(so numbers are never reused), the current epoch with its members, and recent epoch history. Registrations outside
the epoch and heartbeat times are not stored.

Every write is fenced: ``save`` names the ``last_number`` it read, and fails with ``EpochFenced`` if the stored
one differs (another lighthouse wrote first). The etcd implementation maps that onto a transaction comparing
the key's value; the in-memory one compares under a lock. Both pass ``tests/integration/test_store_conformance.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from lighthouse.errors import EpochFenced


@dataclass(frozen=True)
class Capabilities:
    """What a kind of store offers; the server decides from these, never from the store's type."""

    election: bool
    """Lighthouses sharing the store elect one leader (``Store.election``); the others follow (HA)."""
    in_process: bool
    """Calls are quick and local: the server may make them on its event loop instead of a thread."""


class Election(ABC):
    """Leadership of the lighthouses sharing one store. Reports changes through the ``on_change(leading,
    leader_address)`` given to ``Store.election``, on its own thread."""

    @property
    @abstractmethod
    def leading(self) -> bool:
        """Whether this lighthouse leads now."""

    @property
    def leader_reached(self) -> bool:
        """Whether this follower has reached the leader's port, so that it can take over as soon as that port
        refuses connections (False while leading, or where no knock is done)."""
        return False

    @abstractmethod
    def first_round(self) -> None:
        """One campaign on the caller's thread (before ``start``), so the outcome is known at once."""

    @abstractmethod
    def start(self) -> None:
        """Keep campaigning (or renewing) in the background."""

    @abstractmethod
    def stop(self) -> None:
        """Stop; a leader gives up its leadership so that a successor takes over at once."""


class Store(ABC):
    """Durable state of lighthouse jobs, as JSON documents fenced by epoch number."""

    capabilities: ClassVar[Capabilities]

    @abstractmethod
    def load(self, job_id: str) -> dict[str, Any] | None:
        """The job's stored document, or None when nothing was stored yet."""

    @abstractmethod
    def save(self, job_id: str, expected_last_number: int, document: dict[str, Any]) -> None:
        """Replace the job's document if its stored ``last_number`` equals ``expected_last_number``.

        ``document['last_number']`` must not be lower than the expected one (numbers only go up).
        Raises ``EpochFenced`` otherwise; nothing is written then.
        """

    def check_access(self) -> None:
        """One cheap read, at start: ``StoreAccessDenied`` when the store refuses this lighthouse (TLS, client
        certificate: a configuration error), ``StoreUnavailable`` when it does not answer. Nothing to check for a
        store in the process."""
        return None

    def election(self, address: str, http: str, on_change: Callable[[bool, str], None], ttl_s: int,
                 probe_s: float = 0.0, knock: Callable[[str], bool | None] | None = None) -> Election:
        """An election among the lighthouses on this store (only where ``capabilities.election``). ``knock``
        (every ``probe_s``; ``lighthouse.stores.election``): does the leader's port refuse connections?"""
        raise NotImplementedError(f"{type(self).__name__} does not support leader election")

    @abstractmethod
    def close(self) -> None:
        """Release connections."""


def check_monotonic(expected_last_number: int, document: dict[str, Any]) -> None:
    """Refuse a document whose epoch number would go back."""
    if int(document["last_number"]) < expected_last_number:
        raise EpochFenced(f"epoch number would go back: {document['last_number']} < {expected_last_number}")
