"""One rank's step timeline (docs/design.md §8, "Seeing inside a replica"): every step's phases as spans in a bounded
ring, read on demand by ``fthsdp trace`` over the catch-up port (``fthsdp.catchup.server``), never written out on the
step's path.

A span is recorded from two ``time.perf_counter()`` readings the step takes anyway, or around a block (``timed``);
recording is an append under a lock (about a microsecond), so a step of ten phases pays about ten. Times become wall
clock only when read (``read``): the ring keeps the pair (wall, perf) it was made at. A span's times are the host's
view: a phase ends when its last kernel was issued; the exchanges end when FTAR's lane saw them done. On a GPU the
timeline also has a ``DeviceClock``: the points the step takes with ``tick`` get a CUDA event each, and a span
between two of them carries when the device ran it (``device_t0``, ``device_ms``), read when the timeline is read,
never waited for (``device: pending`` while the device has not reached its end).

Phases (``name``, ``cat``): ``forward``, ``backward`` (compute); ``bucket <k>`` (exchange: issue to done, per bucket,
on FTAR's thread); ``wait`` (exchange: the backward's end to the step's exchange settled: the wait for the slowest
peer, redos included); ``vote``; ``optimizer``; ``checkpoint``. Marks: ``role <name>`` and ``epoch <n>``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fthsdp.runtime.device_clock import DeviceClock, TimingEvent

CAPACITY = 4096
"""Events a ring keeps (the oldest go first): about 400 steps of a 6-bucket model, under 0.5 MB to read."""
VERSION = 1
TICKS_KEPT = 64
"""Device events of ticks not yet used by a span that a timeline keeps (a step takes a handful)."""

Event = tuple[int, str, str, str, int, int, float, float, dict[str, Any] | None]
"""``(seq, ph, name, cat, step, epoch, t0, t1, args)``: ``ph`` ``X`` (a span) or ``i`` (a mark, ``t1 == t0``);
times in ``perf_counter`` seconds until read, then Unix seconds."""


class Timeline:
    """The ring of one rank. ``epoch()`` names the epoch an event happened in; ``enabled=False`` records nothing
    (``FTHSDP_TIMELINE=0``)."""

    def __init__(self, capacity: int = CAPACITY, enabled: bool = True,
                 epoch: Callable[[], int] = lambda: 0, clock: DeviceClock | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a timeline keeps at least 1 event, not {capacity}")
        self.enabled = enabled
        self._epoch = epoch
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._seq = 0  # the last event's sequence number
        self._lock = threading.Lock()
        self._wall0, self._perf0 = time.time(), time.perf_counter()
        self._clock = clock if enabled else None
        self._ticks: OrderedDict[float, TimingEvent] = OrderedDict()

    def tick(self) -> float:
        """Now (``perf_counter`` seconds), and with a device clock a device event at this point of the stream: a
        span from one tick to another carries the device's time of the work issued between them."""
        now = time.perf_counter()
        if self._clock is not None:
            event = self._clock.record()
            with self._lock:
                self._ticks[now] = event
                while len(self._ticks) > TICKS_KEPT:
                    self._ticks.popitem(last=False)
        return now

    def span(self, name: str, cat: str, step: int, t0: float, t1: float, **args: Any) -> None:
        """A phase of ``step`` from ``t0`` to ``t1`` (``perf_counter`` seconds; with the device's time of it when
        both are ticks)."""
        if self.enabled:
            if self._clock is not None:
                with self._lock:
                    device = (self._ticks.get(t0), self._ticks.get(t1))
                if device[0] is not None and device[1] is not None:
                    args["_device"] = device
            self._add("X", name, cat, step, t0, max(t0, t1), args or None)

    def mark(self, name: str, step: int, **args: Any) -> None:
        """Something that happened now (a role taken, an epoch seen)."""
        if self.enabled:
            now = time.perf_counter()
            self._add("i", name, "mark", step, now, now, args or None)

    @contextmanager
    def timed(self, name: str, cat: str, step: int) -> Iterator[None]:
        """A span around the block (recorded when it raises too)."""
        t0 = self.tick()
        try:
            yield
        finally:
            self.span(name, cat, step, t0, self.tick())

    def _add(self, ph: str, name: str, cat: str, step: int, t0: float, t1: float,
             args: dict[str, Any] | None) -> None:
        epoch = self._epoch()
        with self._lock:
            self._seq += 1
            self._ring.append((self._seq, ph, name, cat, step, epoch, t0, t1, args))

    def read(self, since: int = 0, limit: int = CAPACITY) -> dict[str, Any]:
        """The events after sequence number ``since`` (at most the newest ``limit``), in Unix seconds, with this
        rank's clock now (``clock``: a reader estimates its offset from the round trip) and how many events the
        ring dropped before the oldest one kept (``dropped``)."""
        with self._lock:
            events = [e for e in self._ring if e[0] > since]
            oldest = self._ring[0][0] if self._ring else self._seq + 1
        events = events[-max(0, limit):] if limit > 0 else []
        shift = self._wall0 - self._perf0
        return {
            "version": VERSION,
            "clock": time.time(),
            "dropped": max(0, oldest - 1 - since),
            "events": [[seq, ph, name, cat, step, epoch, round(t0 + shift, 6), round(t1 + shift, 6),
                        self._read_args(args, shift)] for seq, ph, name, cat, step, epoch, t0, t1, args in events],
        }

    def _read_args(self, args: dict[str, Any] | None, shift: float) -> dict[str, Any]:
        """A span's args as read: its device events as the device's times (``pending`` until it reached both)."""
        if not args or "_device" not in args or self._clock is None:
            return args or {}
        out = {k: v for k, v in args.items() if k != "_device"}
        start, end = (self._clock.seconds(e) for e in args["_device"])
        if start is None or end is None:
            out["device"] = "pending"
        else:
            out["device_t0"], out["device_ms"] = round(start + shift, 6), round(max(0.0, end - start) * 1e3, 3)
        return out


OFF = Timeline(capacity=1, enabled=False)
"""A timeline that records nothing (the default of parts built before the step core's)."""
