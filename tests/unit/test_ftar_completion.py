"""NCCL semantics of a collective in flight (ftar.completion), on the CPU: the rule, the watchers, and the lane
engine driven through a fake NCCL group whose works are "done" once queued and whose failures show only in the
group's error state (docs/gpu.md "NCCL semantics")."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ftar import FTARConfig, Interrupted, LaneEngine
from ftar import engine as engine_mod
from ftar.completion import FutureWatcher, Outcome, Progress, StreamWatcher, Watcher, outcome
from ftar.group import EpochGroup
from ftar.packing import Staging
from ftar.rules import CollectiveWatch, Verdict
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember

# --- the rule ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("progress", "verdict", "expected"), [
    (Progress(True, True, False), Verdict.WAIT, Outcome.DONE),
    (Progress(True, True, False), Verdict.DEADLINE, Outcome.DONE),  # finished in time is finished
    (Progress(True, True, True), Verdict.WAIT, Outcome.FAILED),  # an abort let the stream run on: garbage
    (Progress(True, False, True), Verdict.DEADLINE, Outcome.FAILED),
    (Progress(True, False, False), Verdict.WAIT, Outcome.WAIT),  # queued is not done
    (Progress(False, True, False), Verdict.WAIT, Outcome.WAIT),
    (Progress(True, False, False), Verdict.DEADLINE, Outcome.ABORT_DEADLINE),
    (Progress(True, False, False), Verdict.ABANDON, Outcome.ABORT_EPOCH),
    (Progress(False, False, False), Verdict.ABANDON, Outcome.ABORT_EPOCH),
])
def test_the_rule(progress: Progress, verdict: Verdict, expected: Outcome) -> None:
    assert outcome(progress, verdict) is expected


def test_an_error_wins_over_every_other_input() -> None:
    for enqueued, complete, verdict in itertools.product((False, True), (False, True), Verdict):
        assert outcome(Progress(enqueued, complete, True), verdict) is Outcome.FAILED


# --- the watchers -----------------------------------------------------------------------------------------------


class FakeWork:
    """An NCCL work: its future and ``wait()`` return once queued; ``exception()`` raises, as torch's binding does for
    every work (seen on a GPU), and ``is_success()`` raises, as ``ProcessGroupNCCL`` does (not implemented)."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []

    def wait(self) -> bool:
        self.log.append("stream waits")
        return True

    def exception(self) -> BaseException | None:
        raise TypeError("Unable to convert function return value to a Python type!")

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        raise RuntimeError("ProcessGroupNCCL::WorkNCCL::isSuccess is not implemented")

    def get_future(self) -> torch.futures.Future[None]:
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)  # enqueued
        return fut


class FakeEvent:
    def __init__(self, complete: Callable[[], bool]) -> None:
        self.complete = complete

    def query(self) -> bool:
        return self.complete()


class FakePG:
    def __init__(self) -> None:
        self._errored: BaseException | None = None
        self.aborted = threading.Event()

    def abort(self, errored: bool = True) -> None:
        self._errored = RuntimeError("aborted")
        self.aborted.set()


def errors_of(pg: FakePG) -> Callable[[], str | None]:
    """The group's error state as a lane reads it (``EpochGroup.error``, here torchft's flag only)."""
    return lambda: f"group error: {pg._errored}" if pg._errored is not None else None


def test_nccl_watcher_orders_the_stream_before_recording_its_event() -> None:
    log: list[str] = []
    StreamWatcher(FakeWork(log), errors_of(FakePG()), lambda: log.append("event recorded") or FakeEvent(lambda: True))
    assert log == ["stream waits", "event recorded"]


def test_nccl_watcher_queued_is_not_done_until_the_event_completes() -> None:
    done = [False]
    w = StreamWatcher(FakeWork(), errors_of(FakePG()), lambda: FakeEvent(lambda: done[0]))
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.WAIT
    done[0] = True
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.DONE


def test_nccl_watcher_an_error_after_completion_of_enqueue_is_a_failure() -> None:
    pg = FakePG()
    w = StreamWatcher(FakeWork(), errors_of(pg), lambda: FakeEvent(lambda: True))
    pg._errored = RuntimeError("aborted")  # torchft sets it, then the abort lets the stream run on
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.FAILED
    assert "aborted" in w.error()


def test_nccl_watcher_a_healthy_work_is_done_although_its_exception_binding_raises() -> None:
    """On a GPU every NCCL exchange failed while the watcher asked ``exception()`` (its binding raises)."""
    w = StreamWatcher(FakeWork(), errors_of(FakePG()), lambda: FakeEvent(lambda: True))
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.DONE


def test_nccl_watcher_a_group_that_cannot_say_leaves_it_to_the_deadline() -> None:
    w = StreamWatcher(FakeWork(), lambda: None, lambda: FakeEvent(lambda: False))
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.WAIT
    assert outcome(w.poll(), Verdict.DEADLINE) is Outcome.ABORT_DEADLINE


def test_nccl_watcher_waits_on_the_backend_work_inside_torchfts_wrapper() -> None:
    """torchft's wrapper's ``wait()`` arms a timer of its own; the lane's stream waits on the backend's work."""
    log: list[str] = []
    wrapper = type("Wrapped", (), {"_work": FakeWork(log), "wait": lambda self: log.append("torchft's wait")})()
    StreamWatcher(wrapper, lambda: None, lambda: FakeEvent(lambda: True))
    assert log == ["stream waits"]


class GlooWork:
    """A Gloo work: its future completes when the data is reduced."""

    def __init__(self, fut: torch.futures.Future[None]) -> None:
        self.fut = fut

    def get_future(self) -> torch.futures.Future[None]:
        return self.fut


def test_gloo_watcher_done_means_reduced_and_carries_the_error() -> None:
    ok: torch.futures.Future[None] = torch.futures.Future()
    w: Watcher = FutureWatcher(GlooWork(ok), threading.Event())
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.WAIT
    ok.set_result(None)
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.DONE
    bad: torch.futures.Future[None] = torch.futures.Future()
    w = FutureWatcher(GlooWork(bad), threading.Event())
    bad.set_exception(RuntimeError("peer closed"))
    assert outcome(w.poll(), Verdict.WAIT) is Outcome.FAILED and "peer closed" in w.error()


def test_gloo_watcher_sleeps_until_its_future_completes_or_the_lane_wakes_it() -> None:
    wake = threading.Event()
    fut: torch.futures.Future[None] = torch.futures.Future()
    w = FutureWatcher(GlooWork(fut), wake)
    threading.Timer(0.05, fut.set_result, (None,)).start()
    t0 = time.monotonic()
    w.pause(30.0)  # no polling period: it returns when the future completes
    assert time.monotonic() - t0 < 10.0 and outcome(w.poll(), Verdict.WAIT) is Outcome.DONE
    wake.clear()
    w = FutureWatcher(GlooWork(torch.futures.Future()), wake)
    threading.Timer(0.05, wake.set).start()  # the lane's signal: a pushed epoch, exclusion, closing
    t0 = time.monotonic()
    w.pause(30.0)
    assert time.monotonic() - t0 < 10.0 and outcome(w.poll(), Verdict.WAIT) is Outcome.WAIT


def test_a_collective_watch_sleeps_until_its_deadline_or_its_give_up_time() -> None:
    e1, e2 = epoch(1, ("r0", "r1")), epoch(2, ("r0", "r1", "r2"))
    watch = CollectiveWatch(e1, 100.0, timeout_s=5.0, grace_s=1.0)
    assert watch.left(100.0) == pytest.approx(watch.deadline - 100.0)
    assert watch.notice(e2, 101.0)  # a join: a grace, not at once
    assert watch.left(101.0) == pytest.approx(1.0) and watch.left(103.0) == 0.0
    assert watch.verdict(102.0, stopping=False) is Verdict.ABANDON


# --- the engine with a fake NCCL group ------------------------------------------------------------------------


def epoch(number: int, ids: tuple[str, ...]) -> EpochView:
    members = tuple(EpochMember(r, "i", ACTIVE, 1, Endpoints()) for r in ids)
    return EpochView("job", number, members, f"store/epoch{number}", 0.0, "test")


class FakeMembership:
    replica_id = "r0"

    def __init__(self, first: EpochView) -> None:
        self.epoch = first
        self.cond = threading.Condition()
        self.listeners: list[Callable[[EpochView], None]] = []
        self.reports: list[tuple[str, int]] = []
        self.early_reports: list[tuple[str, int]] = []
        self.on_report: Callable[[], None] = lambda: None

    def current(self) -> EpochView:
        return self.epoch

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        with self.cond:
            self.cond.wait_for(lambda: self.epoch.number > after, timeout)
            return self.epoch if self.epoch.number > after else None

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        if early:  # a lighthouse without evidence (the suspect's connection is open): changes nothing
            self.early_reports.append((suspect, epoch))
            return
        self.reports.append((suspect, epoch))
        self.on_report()

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        self.listeners.append(fn)
        return lambda: None

    def push(self, e: EpochView) -> None:
        with self.cond:
            self.epoch = e
            self.cond.notify_all()
        for fn in self.listeners:
            fn(e)


class FakeStore:
    def __init__(self) -> None:
        self.keys: set[str] = set()

    def set(self, key: str, value: bytes) -> None:
        self.keys.add(key)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


class FakeNcclGroup(EpochGroup):
    """Every member sends what this one sends (SUM multiplies by the world, MAX keeps it). The data exchanges
    of the epochs in ``scripts`` behave as scripted: ``error`` (queued, the stream runs on over a half-reduced
    buffer after torchft's abort: the group records the error), ``hang`` (never completes)."""

    scripts: dict[int, str] = {}
    groups: list[FakeNcclGroup] = []
    fake: FakePG
    started = threading.Event()
    hung_once = False

    @classmethod
    def open(cls, epoch: EpochView, replica_id: str, *args: Any) -> EpochGroup:  # type: ignore[override]
        group = cls(epoch, epoch.replica_ids.index(replica_id), FakeStore(), FakePG(), Staging(torch.device("cpu")))
        group.fake = group.pg  # the lane hands the group's pg to the reaper when it gives the group up
        cls.groups.append(group)
        return group

    def allreduce(self, tensor: torch.Tensor, op: Any, timeout_s: float) -> Any:
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(self.world)
        return FakeWork()

    def start_exchange(self, buffers: list[torch.Tensor], timeout_s: float) -> list[Any]:
        self.seq += 1
        script = self.scripts.get(self.epoch.number, "ok")
        if script == "hang-once":  # the first exchange of the epoch hangs, the next ones go through
            script, FakeNcclGroup.hung_once = ("ok" if FakeNcclGroup.hung_once else "hang"), True
        FakeNcclGroup.started.set()
        if script == "ok":
            return [self.allreduce(b, torch.distributed.ReduceOp.SUM, timeout_s) for b in buffers]
        if script == "error":
            for b in buffers[:-1]:
                b.fill_(float("nan"))  # half-reduced garbage
            self.fake._errored = RuntimeError("aborted: peer gone")
        self._hang = script == "hang"
        return [FakeWork() for _ in buffers]

    def watch(self, work: Any, wake: threading.Event) -> Watcher:
        hang = getattr(self, "_hang", False)
        return StreamWatcher(work, self.error, lambda: FakeEvent(lambda: not hang), wake)


@pytest.fixture
def fake_groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeNcclGroup]]:
    monkeypatch.setattr(engine_mod, "EpochGroup", FakeNcclGroup)
    FakeNcclGroup.scripts, FakeNcclGroup.groups = {}, []
    FakeNcclGroup.started = threading.Event()
    FakeNcclGroup.hung_once = False
    yield FakeNcclGroup


def run(fake: type[FakeNcclGroup], membership: FakeMembership, config: FTARConfig,
        during: Callable[[], None] = lambda: None, **kw: Any) -> tuple[torch.Tensor, Any]:
    eng = LaneEngine(membership, 0, config)
    try:
        t = torch.arange(6, dtype=torch.float32)
        handle = eng.allreduce([t], tag=5, **kw)
        during()
        try:
            return t, handle.wait(20)
        except Interrupted as e:
            return t, e
    finally:
        eng.close(timeout=5)


CONFIG = FTARConfig(timeout_s=5.0, blame_grace_s=0.05, epoch_wait_s=5.0, connect_timeout_s=1.0)


def test_an_error_after_completion_of_enqueue_is_not_taken_as_the_result(fake_groups: type[FakeNcclGroup]) -> None:
    fake_groups.scripts = {1: "error"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    m.on_report = lambda: m.push(epoch(2, ("r0", "r1")))  # the lighthouse re-forms after the report
    t, result = run(fake_groups, m, CONFIG)
    assert result.epoch == 2 and result.attempts == 2  # redone in the next epoch, from the intact inputs
    assert torch.equal(result.tensors[0], torch.arange(6, dtype=torch.float32))
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    assert m.reports == [("r1", 1)]  # a failure: the member that did not check in is blamed


def test_an_error_after_enqueue_interrupts_a_no_redo_exchange(fake_groups: type[FakeNcclGroup]) -> None:
    fake_groups.scripts = {1: "error"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    t, result = run(fake_groups, m, CONFIG, redo=False)
    assert isinstance(result, Interrupted)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))


def test_a_deadline_aborts_the_communicator(fake_groups: type[FakeNcclGroup]) -> None:
    fake_groups.scripts = {1: "hang"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    config = FTARConfig(timeout_s=0.2, blame_grace_s=2.0, epoch_wait_s=5.0, connect_timeout_s=1.0)
    aborted_at: list[float] = []

    def watch_abort() -> None:
        fake_groups.started.wait(10)
        t0 = time.monotonic()
        if fake_groups.groups[0].fake.aborted.wait(10):
            aborted_at.append(time.monotonic() - t0)

    t, result = run(fake_groups, m, config, during=watch_abort, redo=False)
    assert isinstance(result, Interrupted)
    # Aborted at the deadline (timeout + slack), before the blame grace (2 s) was over: not at the release.
    assert aborted_at and aborted_at[0] < 0.2 + 0.5 + 1.5
    assert m.reports == [("r1", 1)]


def test_a_replica_alone_redoes_in_its_epoch_after_a_deadline(fake_groups: type[FakeNcclGroup]) -> None:
    """Seen on a GPU: alone in its epoch, a failed collective left nobody to report and the lane waited for an
    epoch that never came. Now the communicator is aborted and the exchange redone in the same epoch."""
    fake_groups.scripts = {1: "hang-once"}
    m = FakeMembership(epoch(1, ("r0",)))
    config = FTARConfig(timeout_s=0.2, blame_grace_s=0.05, epoch_wait_s=5.0, connect_timeout_s=1.0)
    t, result = run(fake_groups, m, config)
    assert not isinstance(result, Exception), result
    assert result.epoch == 1 and result.attempts == 2
    assert torch.equal(result.tensors[0], torch.arange(6, dtype=torch.float32))
    assert fake_groups.groups[0].fake.aborted.is_set() and len(fake_groups.groups) == 2  # aborted, then rebuilt
    assert m.reports == []


def test_an_epoch_push_aborts_the_communicator_without_blame(fake_groups: type[FakeNcclGroup]) -> None:
    fake_groups.scripts = {1: "hang"}
    m = FakeMembership(epoch(1, ("r0", "r1")))

    def push() -> None:
        assert fake_groups.started.wait(10)
        m.push(epoch(2, ("r0",)))  # r1 dropped: abandon at once

    t, result = run(fake_groups, m, CONFIG, during=push)
    assert fake_groups.groups[0].fake.aborted.is_set()
    assert result.epoch == 2 and result.contributors == 1
    assert torch.equal(result.tensors[0], torch.arange(6, dtype=torch.float32))
    assert m.reports == []


# --- stream ordering by events ----------------------------------------------------------------------------------


def test_the_lane_reads_the_inputs_after_the_callers_event_and_hands_one_back(
        fake_groups: type[FakeNcclGroup], monkeypatch: pytest.MonkeyPatch) -> None:
    from ftar import devices

    log: list[tuple[str, object]] = []
    produced = object()
    monkeypatch.setattr(devices, "wait_for", lambda ev: log.append(("wait", ev)) if ev is not None else None)
    monkeypatch.setattr(devices, "record", lambda device: log.append(("record", None)) or "result-event")
    real_start = FakeNcclGroup.start_exchange

    def start(self: FakeNcclGroup, buffers: list[torch.Tensor], timeout_s: float) -> list[Any]:
        log.append(("exchange", None))
        return real_start(self, buffers, timeout_s)

    monkeypatch.setattr(FakeNcclGroup, "start_exchange", start)
    m = FakeMembership(epoch(1, ("r0", "r1")))
    _, result = run(fake_groups, m, CONFIG, ready=produced)
    assert result.ready == "result-event"
    # The producer's event first, then the exchange, then the result's event, on which the waiting thread waits.
    assert log == [("wait", produced), ("exchange", None), ("record", None), ("wait", "result-event")]
