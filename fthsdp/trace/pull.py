"""Reading the ranks' step timelines (``fthsdp.runtime.timeline``) over their catch-up ports: a ``TRACE`` request
answered with the rank's events and its replica's directory of ranks (``fthsdp.catchup.wire``), proven with the job
token for the session's nonce, never sent (``fthsdp.catchup.auth.trace_proof``).

``Collector`` keeps what it read per rank incarnation, asking each time only for the events after the last it holds:
pulled every second while a job runs (``fthsdp demo --trace``), a killed incarnation's steps up to its last pull stay
in the trace. Each read estimates the rank's clock offset from the round trip (the midpoint rule), so ranks of
different hosts line up on the reader's clock.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fthsdp.catchup import auth, wire
from fthsdp.catchup.wire import CatchupError, Kind, TraceRequest

log = logging.getLogger("fthsdp.trace")

TIMEOUT_S = 5.0
"""A rank's read (connect, challenge, answer) at most."""


@dataclass(frozen=True)
class RankRead:
    """One rank's answer to a timeline read."""

    replica: str
    incarnation: str
    rank: int
    directory: tuple[str, ...]
    """Every rank's catch-up address in its replica (index = rank)."""
    timeline: dict[str, Any]
    """``fthsdp.runtime.timeline.Timeline.read``'s document."""
    offset_s: float
    """The rank's clock minus the reader's (estimated from the round trip)."""


def read_rank(address: str, job: str, token: str, since: int = 0, timeout_s: float = TIMEOUT_S) -> RankRead:
    """The timeline of the rank serving catch-up at ``address``, events after ``since``. Raises ``CatchupError``
    (``Refused``: a wrong token or job), ``OSError`` or ``ValueError`` on a bad answer."""
    with socket.create_connection(wire.split_address(address), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        _, challenge = wire.recv_control(sock, (Kind.CHALLENGE,))
        nonce = wire.parse_challenge(challenge)
        request = TraceRequest(job, since)
        request = TraceRequest(job, since, auth.trace_proof(token, nonce, request))
        t0 = time.time()
        wire.send_control(sock, Kind.TRACE, wire.trace_doc(request))
        _, obj = wire.recv_control(sock, (Kind.TIMELINE,))
        t1 = time.time()
    doc = obj.get("timeline")
    directory = obj.get("directory")
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list) or not isinstance(directory, list) \
            or not all(isinstance(x, str) for x in directory) or not isinstance(doc.get("clock"), (int, float)):
        raise ValueError(f"{address}: a malformed timeline answer")
    return RankRead(wire.str_field(obj, "replica", 256), wire.str_field(obj, "incarnation", 256),
                    int(obj.get("rank", -1)), tuple(directory), doc, float(doc["clock"]) - (t0 + t1) / 2)


@dataclass
class Track:
    """What the reader holds of one rank incarnation."""

    replica: str
    incarnation: str
    rank: int
    events: dict[int, list[Any]] = field(default_factory=dict)
    """By sequence number: ``[seq, ph, name, cat, step, epoch, t0, t1, args]``, times on the reader's clock."""
    last: int = 0
    dropped: int = 0
    """Events the rank's ring had dropped before this reader got them."""

    def take(self, read: RankRead) -> None:
        doc = read.timeline
        self.dropped += int(doc.get("dropped", 0))
        for e in doc["events"]:
            if isinstance(e, list) and len(e) == 9 and isinstance(e[0], int):
                self.events[e[0]] = [*e[:6], float(e[6]) - read.offset_s, float(e[7]) - read.offset_s, e[8]]
                self.last = max(self.last, e[0])


class Collector:
    """Every rank's timeline of one job, read from the replicas' catch-up endpoints (rank 0's, as the lighthouse
    lists them: each answer names its replica's other ranks)."""

    def __init__(self, job: str, token: str) -> None:
        self.job, self.token = job, token
        self.tracks: dict[tuple[str, str, int], Track] = {}
        self.errors: list[str] = []
        """What the last ``pull`` could not read (``address: why``)."""

    def _since(self, replica: str, incarnation: str, rank: int) -> int:
        t = self.tracks.get((replica, incarnation, rank))
        return t.last if t is not None else 0

    def _read(self, address: str, expect: tuple[str, str, int]) -> RankRead | None:
        since = self._since(*expect)
        try:
            read = read_rank(address, self.job, self.token, since)
            if since != self._since(read.replica, read.incarnation, read.rank):  # another process answered there
                read = read_rank(address, self.job, self.token, self._since(read.replica, read.incarnation, read.rank))
        except (CatchupError, OSError, ValueError) as e:
            self.errors.append(f"{address}: {e}")
            return None
        key = (read.replica, read.incarnation, read.rank)
        self.tracks.setdefault(key, Track(*key)).take(read)
        return read

    def pull(self, members: list[tuple[str, str, str]]) -> int:
        """Read every rank of ``members`` (replica id, incarnation, rank 0's catch-up address): returns the ranks
        read."""
        self.errors = []
        n = 0
        for replica, incarnation, address in members:
            if not address:
                continue
            first = self._read(address, (replica, incarnation, 0))
            if first is None:
                continue
            n += 1
            for rank, other in enumerate(first.directory):
                if rank != first.rank and self._read(other, (first.replica, first.incarnation, rank)) is not None:
                    n += 1
        return n


def members_of(status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(replica id, incarnation, rank 0's catch-up address) of every member a lighthouse's ``/status`` lists."""
    return [(str(m["replica_id"]), str(m.get("incarnation", "")), str(m.get("catchup") or ""))
            for m in status.get("members", ())]


class Follower:
    """Reads a job's ranks about every ``period_s`` while a launcher supervises it (``fthsdp demo --trace``):
    ``tick`` is cheap between reads. Keeps the lighthouse's newest epoch history for the trace's marks."""

    def __init__(self, collector: Collector, status: Callable[[], dict[str, Any]], period_s: float = 1.0) -> None:
        self.collector, self._status, self.period_s = collector, status, period_s
        self.history: list[dict[str, Any]] = []
        self._next = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.period_s
        try:
            status = self._status()
        except (OSError, ValueError) as e:  # the lighthouse restarting, or gone at the end
            log.debug("trace: no status: %s", e)
            return
        self.history = list(status.get("history", ()))
        self.collector.pull(members_of(status))
