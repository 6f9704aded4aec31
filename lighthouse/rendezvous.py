"""The data plane's rendezvous as the lighthouse keeps it (docs/design.md §5): a key-value store per job and epoch
with ``torch.distributed.Store`` semantics, served over the authenticated gRPC port (``lighthouse.server.rdzv``)
instead of an open TCPStore.

Pure: no I/O, no clock. ``RendezvousTable`` holds one job's namespaces (``<job>/epoch<N>``), admits only the
current epoch and a few recent ones (``admissible``), drops the older ones, and bounds everything a holder of
the token could grow (``Limits``). A refused call raises ``RendezvousRefused`` and changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lighthouse import lane_hosts
from lighthouse.errors import ValidationError

SCHEME = "lighthouse:"
"""Prefix of ``Epoch.rendezvous`` when the lighthouse's gRPC Rendezvous service hosts it."""
MEMBERS_SCHEME = "members:"
"""Prefix of ``Epoch.rendezvous`` when each lane meets on a store one of its members hosts (``lighthouse.lane_hosts``,
``ftar.lane_store``), found from the addresses the members keep."""
ANNOUNCED_SCHEME = "members+lighthouse:"
"""The same, with each host's address also on the lighthouse's store (``lane<L>/host`` in the epoch's namespace) for
the members that do not know it."""
NAMESPACE_RE = re.compile(r"(?P<job>[A-Za-z0-9][A-Za-z0-9._:-]{0,127})/epoch(?P<n>[1-9][0-9]{0,18})")
KEEP_EPOCHS = 4
"""Namespaces kept besides the current epoch's and its data plane's: members a little behind still find theirs."""


@dataclass(frozen=True)
class Limits:
    """Bounds per call and per namespace (sized for Gloo/NCCL rendezvous: a few small keys per member)."""

    key_chars: int = 512
    value_bytes: int = 32 * 1024
    keys_per_call: int = 1024
    keys_per_namespace: int = 8192
    bytes_per_namespace: int = 8 << 20
    wait_s: float = 600.0


class RendezvousRefused(ValidationError):
    """A malformed or over-limit rendezvous call (answered INVALID_ARGUMENT); it changed nothing."""


class OutOfRange(RendezvousRefused):
    """The namespace names an epoch that is not admitted (a future one, or one already dropped)."""


HOSTING_SCHEMES = {lane_hosts.MEMBERS: MEMBERS_SCHEME, lane_hosts.ANNOUNCED: ANNOUNCED_SCHEME,
                   lane_hosts.LIGHTHOUSE: SCHEME}
"""An epoch's ``hosting`` -> the prefix of its rendezvous, when the lighthouse lets members host."""


def hosting_of(rendezvous: str) -> tuple[str, str] | None:
    """(the ``lane_hosts`` mode, the namespace) of a rendezvous on the lighthouse's service or on members' stores;
    ``None`` for any other (a TCPStore's address, none)."""
    for mode, scheme in HOSTING_SCHEMES.items():
        if rendezvous.startswith(scheme):
            return mode, rendezvous[len(scheme):]
    return None


def namespace_of(job_id: str, number: int) -> str:
    """The namespace of epoch ``number`` of ``job_id``."""
    return f"{job_id}/epoch{number}"


def parse_namespace(job_id: str, namespace: str) -> int:
    """The epoch number of ``namespace``, which must be ``<job_id>/epoch<N>``."""
    m = NAMESPACE_RE.fullmatch(namespace)
    if m is None:
        raise RendezvousRefused(f"namespace {namespace[:80]!r} is not '<job>/epoch<N>'")
    if m["job"] != job_id:
        raise RendezvousRefused(f"namespace {namespace[:80]!r} belongs to another job than {job_id!r}")
    return int(m["n"])


def admissible(number: int, current: int, plane: int, keep: int = KEEP_EPOCHS) -> bool:
    """Whether epoch ``number``'s namespace may be used while ``current`` is the job's epoch and ``plane`` the
    epoch whose groups it keeps: the current one, its plane, or one of the ``keep`` before the current one."""
    return 0 < number <= current and (number == plane or number > current - 1 - keep)


def check_key(key: str, limits: Limits) -> str:
    """``key`` if it is 1 to ``limits.key_chars`` printable characters."""
    if not key or len(key) > limits.key_chars or not key.isprintable():
        raise RendezvousRefused(f"key {key[:80]!r} is not 1-{limits.key_chars} printable characters")
    return key


def check_keys(keys: list[str] | tuple[str, ...], limits: Limits, *, one: bool = False) -> list[str]:
    """Every key checked; ``one``: exactly one key."""
    if one and len(keys) != 1:
        raise RendezvousRefused(f"this call takes exactly one key, got {len(keys)}")
    if not keys or len(keys) > limits.keys_per_call:
        raise RendezvousRefused(f"1 to {limits.keys_per_call} keys per call, got {len(keys)}")
    return [check_key(k, limits) for k in keys]


def check_wait(timeout_s: float, limits: Limits) -> float:
    """A wait's timeout, bounded to ``[0, limits.wait_s]`` (NaN or negative refused)."""
    if not timeout_s >= 0:
        raise RendezvousRefused(f"timeout_s must be >= 0, got {timeout_s}")
    return min(timeout_s, limits.wait_s)


@dataclass
class Namespace:
    """One epoch's keys."""

    values: dict[str, bytes] = field(default_factory=dict)
    size: int = 0

    def has(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


class RendezvousTable:
    """One job's rendezvous namespaces. Every method either does all of its work or raises and does none."""

    def __init__(self, job_id: str, limits: Limits | None = None) -> None:
        self.job_id = job_id
        self.limits = limits or Limits()
        self.namespaces: dict[int, Namespace] = {}

    def namespace(self, namespace: str, current: int, plane: int, keep: int = KEEP_EPOCHS) -> tuple[int, Namespace]:
        """The namespace named (created on first use) once admitted; drops those no longer admissible."""
        n = parse_namespace(self.job_id, namespace)
        for old in [x for x in self.namespaces if not admissible(x, current, plane, keep)]:
            del self.namespaces[old]
        if not admissible(n, current, plane, keep):
            raise OutOfRange(f"epoch {n} is not a current or recent epoch of job {self.job_id!r} "
                             f"(current: {current})")
        return n, self.namespaces.setdefault(n, Namespace())

    def _store(self, ns: Namespace, key: str, value: bytes) -> None:
        lim = self.limits
        if len(value) > lim.value_bytes:
            raise RendezvousRefused(f"value of {len(value)} bytes exceeds {lim.value_bytes}")
        old = ns.values.get(key)
        if old is None and len(ns.values) >= lim.keys_per_namespace:
            raise RendezvousRefused(f"the namespace already holds {lim.keys_per_namespace} keys")
        size = ns.size + len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if size > lim.bytes_per_namespace:
            raise RendezvousRefused(f"the namespace would exceed {lim.bytes_per_namespace} bytes")
        ns.values[key] = value
        ns.size = size

    def set(self, ns: Namespace, key: str, value: bytes) -> None:
        self._store(ns, check_key(key, self.limits), value)

    def add(self, ns: Namespace, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer under ``key`` (absent: 0), like TCPStore."""
        check_key(key, self.limits)
        raw = ns.values.get(key, b"0")
        try:
            value = int(raw.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise RendezvousRefused(f"key {key[:80]!r} does not hold an integer") from None
        self._store(ns, key, str(value).encode("ascii"))
        return value

    def compare_set(self, ns: Namespace, key: str, expected: bytes, desired: bytes) -> bytes:
        """Store ``desired`` if the key holds ``expected`` (or is absent and ``expected`` is empty); returns the
        value now stored (``expected`` when the key is absent and ``expected`` is not empty, like TCPStore)."""
        check_key(key, self.limits)
        current = ns.values.get(key)
        if current is None and expected:
            return expected
        if current is None or current == expected:
            self._store(ns, key, desired)
            return desired
        return current

    def delete(self, ns: Namespace, key: str) -> bool:
        check_key(key, self.limits)
        old = ns.values.pop(key, None)
        if old is None:
            return False
        ns.size -= len(key) + len(old)
        return True
