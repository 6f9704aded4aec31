"""Simulated time and network for ``fthsdp chaos --sim``: one event queue, one clock, one seeded random source.

Nothing here sleeps or reads a clock: an event runs at its simulated time, in the order it was scheduled among
events of the same time, so a seed replays bit for bit. Messages between a replica and the lighthouse cross a
``Net`` whose faults (latency, extra delay that reorders, loss, duplication, partitions) are windows the fault
schedule opens.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

LATENCY_S = (0.0005, 0.003)
"""One way, uniform: loopback-like."""


class World:
    """The clock, the queue and the random source of one simulated run."""

    def __init__(self, seed: int, trace: bool = False) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.tracing = trace
        self.trace: list[str] = []
        self.events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulated time ``t`` (never before now)."""
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def log(self, text: str) -> None:
        """One line of the run's trace (kept only with ``trace``)."""
        if self.tracing:
            self.trace.append(f"{self.now:9.4f}  {text}")

    def run(self, until: float, max_events: int) -> None:
        """Run the events due up to ``until``; ``RuntimeError`` past ``max_events`` (a livelock)."""
        while self._queue and self._queue[0][0] <= until:
            t, _, fn = heapq.heappop(self._queue)
            self.now = t
            self.events += 1
            if self.events > max_events:
                raise RuntimeError(f"more than {max_events} events by t={t:.3f}s: a livelock")
            fn()
        self.now = max(self.now, until)


@dataclass
class Window:
    """A fault on one replica's messages, from ``start`` to ``end``."""

    start: float
    end: float
    kind: str
    """``cut`` (replica and lighthouse cannot reach each other), ``peers`` (the replica and its peers cannot),
    ``delay`` (up to ``extra_s`` more per message), ``dup`` (requests arrive twice)."""
    extra_s: float = 0.0


@dataclass
class Net:
    """Per-replica fault windows, and the lighthouse's up/down state."""

    world: World
    windows: dict[str, list[Window]] = field(default_factory=dict)
    lighthouse_down_until: float = -1.0

    def _open(self, replica_id: str, kind: str) -> Window | None:
        now = self.world.now
        return next((w for w in self.windows.get(replica_id, ()) if w.kind == kind and w.start <= now < w.end),
                    None)

    def cut_from_lighthouse(self, replica_id: str) -> bool:
        return self._open(replica_id, "cut") is not None or self.world.now < self.lighthouse_down_until

    def cut_from_peers(self, replica_id: str) -> bool:
        return self._open(replica_id, "peers") is not None

    def reconnect_at(self, replica_id: str) -> float:
        """When a watch stream of the replica is back: once its cut (and the lighthouse's downtime) is over."""
        now = self.world.now
        ends = [w.end for w in self.windows.get(replica_id, ()) if w.kind == "cut" and w.start <= now < w.end]
        return max([self.world.now, self.lighthouse_down_until, *ends])

    def latency(self, replica_id: str) -> float:
        d = self.world.rng.uniform(*LATENCY_S)
        w = self._open(replica_id, "delay")
        return d + (self.world.rng.uniform(0.0, w.extra_s) if w is not None else 0.0)

    def copies(self, replica_id: str) -> int:
        """How many times a request arrives (a ``dup`` window: sometimes twice)."""
        return 2 if self._open(replica_id, "dup") is not None and self.world.rng.random() < 0.5 else 1
