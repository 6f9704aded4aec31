"""A rank's phases as its device ran them (issue 40): CUDA timing events at the timeline's ticks, read when the
timeline is read and never waited for on the step's path (``fthsdp.runtime.device_clock``), and their own track
under the rank in the Chrome trace. On CPU with a fake device whose events complete when the test says so."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fthsdp.runtime.device_clock import DeviceClock
from fthsdp.runtime.timeline import Timeline
from fthsdp.trace import chrome
from fthsdp.trace.pull import Track

pytestmark = pytest.mark.timeout(60)


class FakeDevice:
    """A stream: events complete in order when ``run_until`` says the device got that far (device milliseconds)."""

    def __init__(self) -> None:
        self.recorded: list[FakeEvent] = []
        self.reached = 0  # events the device has run to
        self.syncs = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def run_until(self, n: int, ms: list[float]) -> None:
        """The device reached the first ``n`` recorded events, at ``ms`` (device milliseconds) each."""
        for e, t in zip(self.recorded[self.reached:n], ms, strict=True):
            e.at_ms = t
        self.reached = n


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at_ms: float | None = None

    def record(self) -> None:
        self.device.recorded.append(self)

    def query(self) -> bool:
        return self.at_ms is not None

    def synchronize(self) -> None:
        self.device.syncs += 1
        if self.at_ms is None:
            self.device.run_until(self.device.recorded.index(self) + 1,
                                  [0.0] * (self.device.recorded.index(self) + 1 - self.device.reached))

    def elapsed_time(self, end: Any) -> float:
        assert self.at_ms is not None and end.at_ms is not None, "elapsed_time of an event not reached"
        return float(end.at_ms - self.at_ms)


def test_a_span_between_ticks_carries_when_the_device_ran_it_read_later_never_waited_for() -> None:
    dev = FakeDevice()
    clock = DeviceClock(dev.event)
    assert dev.syncs == 1  # the reference, once, at start-up
    tl = Timeline(epoch=lambda: 3, clock=clock)
    t0 = tl.tick()
    t1 = tl.tick()  # the forward's kernels were issued in between, in no time on the host
    tl.span("forward", "compute", 5, t0, t1)
    with tl.timed("optimizer", "optimizer", 5):
        pass
    tl.span("bucket 0", "exchange", 5, t0, time.perf_counter())  # not ticks (FTAR's thread): the host's view only
    assert dev.syncs == 1 and len(dev.recorded) == 5  # the reference and 4 ticks; nothing waited on
    pending = tl.read()["events"]
    assert [e[8] for e in pending] == [{"device": "pending"}, {"device": "pending"}, {}]
    dev.run_until(3, [250.0, 400.0])  # the device ran the forward from 250 ms to 400 ms after the reference
    args = tl.read()["events"][0][8]
    assert args["device_ms"] == pytest.approx(150.0)
    # On the host's scale: the reference's host time + 250 ms (the host's view of the span took microseconds).
    assert args["device_t0"] == pytest.approx(tl.read()["events"][0][6] + 0.25, abs=0.05)
    assert tl.read()["events"][1][8] == {"device": "pending"}  # the optimizer's end not reached yet
    dev.run_until(5, [400.0, 430.0])
    assert tl.read()["events"][1][8]["device_ms"] == pytest.approx(30.0)
    assert dev.syncs == 1


def test_without_a_device_clock_or_with_the_timeline_off_no_event_is_recorded() -> None:
    dev = FakeDevice()
    off = Timeline(enabled=False, clock=DeviceClock(dev.event))
    a = off.tick()
    off.span("forward", "compute", 0, a, off.tick())
    assert len(dev.recorded) == 1 and off.read()["events"] == []  # the reference only
    cpu = Timeline()
    b = cpu.tick()
    cpu.span("forward", "compute", 0, b, cpu.tick())
    assert cpu.read()["events"][0][8] == {}


def test_a_timeline_keeps_a_bounded_number_of_unused_ticks() -> None:
    dev = FakeDevice()
    tl = Timeline(clock=DeviceClock(dev.event))
    first = tl.tick()
    for _ in range(1000):
        tl.tick()
    last = tl.tick()
    tl.span("forward", "compute", 0, first, last)  # its start was forgotten: the host's view only
    assert tl.read()["events"][0][8] == {} and len(tl._ticks) <= 64


def test_the_trace_puts_a_ranks_device_spans_on_a_track_of_their_own() -> None:
    tr = Track("replica-0", "a", 1)
    tr.events = {1: [1, "X", "forward", "compute", 4, 2, 100.0, 100.001, {"device_t0": 100.05, "device_ms": 120.0}],
                 2: [2, "X", "vote", "vote", 4, 2, 100.2, 100.21, {"device": "pending"}]}
    doc = chrome.build([tr])
    assert chrome.problems(doc) == []
    procs, threads = chrome.names(doc)
    device = [e for e in doc["traceEvents"] if e["ph"] == "X" and threads[(e["pid"], e["tid"])] == "rank 1, device"]
    assert len(device) == 1 and device[0]["name"] == "forward"
    assert device[0]["ts"] == pytest.approx(0.05e6) and device[0]["dur"] == pytest.approx(120e3)
    assert chrome.rank_tracks(doc) == {"replica-0": ["rank 1"]}  # the device's track is the rank's, not a rank
