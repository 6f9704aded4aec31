"""When the device ran a step's phases (issue 40; docs/design.md §8, "Seeing inside a replica"): CUDA events recorded
on the current stream at the points the timeline's spans begin and end, read only when the timeline is read (``fthsdp
trace``), never waited for on the step's path.

A span's host times say when its work was issued; on a GPU the kernels run later, asynchronously, so the host view
of a forward pass can be a few milliseconds while the device spends a hundred on it. ``DeviceClock.record`` puts a
timing event on the stream (no sync: the host goes on), ``seconds`` reads when the device reached it, on the host's
``perf_counter`` scale, or ``None`` while it has not (``query``: no wait). The scales are tied once, at start-up (one
event recorded and synchronized before any step), so a device time is that reference's host time plus the elapsed
device time between the two events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class TimingEvent(Protocol):
    """What ``torch.cuda.Event(enable_timing=True)`` offers the clock."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class DeviceClock:
    """Device times of points on the current stream of one device, tied to this process's ``perf_counter``."""

    def __init__(self, new_event: Callable[[], TimingEvent]) -> None:
        self._new = new_event
        self._ref = new_event()
        self._ref.record()
        self._ref.synchronize()  # once, before any step: the device reached the reference now
        self._ref_perf = time.perf_counter()

    @classmethod
    def for_device(cls, device: torch.device) -> DeviceClock:
        """The clock of CUDA ``device`` (events on whatever stream is current where ``record`` is called)."""
        with torch.cuda.device(device):
            return cls(lambda: torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]

    def record(self) -> TimingEvent:
        """An event on the current stream, reached when the work issued before it has run (no sync)."""
        event = self._new()
        event.record()
        return event

    def seconds(self, event: TimingEvent) -> float | None:
        """When the device reached ``event`` (``perf_counter`` seconds), ``None`` while it has not."""
        if not event.query():
            return None
        return self._ref_perf + self._ref.elapsed_time(event) / 1e3
