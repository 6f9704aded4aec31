"""Heartbeat deadlines in a heap, so that the lighthouse's liveness tick (20 a second) looks only at the members
whose timeout may have passed, not at every member: in a steady 10,000-replica job a tick costs a heap peek.

Heartbeats do not touch the heap (they only stamp ``last_seen``): each member's entry is refreshed lazily when it
comes due, from its latest heartbeat, so a member costs one heap operation per timeout period."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping


class Deadlines:
    """When each member's heartbeat timeout would pass, as of its heartbeat when that was last looked at."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._heap: list[tuple[float, str]] = []

    def add(self, replica_ids: Iterable[str], last_seen: Mapping[str, float]) -> None:
        """Watch ``replica_ids`` (new members), from their ``last_seen``."""
        for rid in replica_ids:
            if rid in last_seen:
                heapq.heappush(self._heap, (last_seen[rid] + self.timeout_s, rid))

    def due(self, now: float, last_seen: Mapping[str, float]) -> frozenset[str]:
        """The watched members silent for the timeout or more at ``now``. Entries of members gone from
        ``last_seen`` are forgotten; members heard from since are pushed back to their new deadline; the silent
        ones stay due until they are gone."""
        heap, out, timeout_s = self._heap, [], self.timeout_s
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            seen = last_seen.get(rid)
            if seen is None:
                continue
            if seen + timeout_s <= now:
                out.append(rid)
            else:
                heapq.heappush(heap, (seen + timeout_s, rid))
        for rid in out:  # checked again at every tick until the decision drops it
            heapq.heappush(heap, (now, rid))
        return frozenset(out)

    def __len__(self) -> int:
        return len(self._heap)
