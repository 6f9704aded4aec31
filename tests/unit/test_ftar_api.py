"""FTAR engine argument checks and lifecycle, without a network (a membership that never has an epoch)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from ftar import EngineClosed, Excluded, FTARConfig, LaneEngine, NoEpoch, rules
from fthsdp.runtime.commit import CommitProtocol, Exchanged, Failed, Failure, Tally
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember


class NoMembership:
    replica_id = "r0"

    def current(self) -> EpochView | None:
        return None

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        threading.Event().wait(min(timeout, 0.01))
        return None

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        raise AssertionError("nothing to report")

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        return lambda: None


@pytest.fixture
def engine() -> Iterator[LaneEngine]:
    eng = LaneEngine(NoMembership(), 0, FTARConfig(epoch_wait_s=0.2))
    yield eng
    eng.close()


def test_bad_arguments_are_refused_at_the_call(engine: LaneEngine) -> None:
    with pytest.raises(ValueError, match="op"):
        engine.allreduce([torch.ones(2)], op="max")
    with pytest.raises(ValueError, match="nothing"):
        engine.allreduce([])
    with pytest.raises(ValueError, match="inplace"):
        engine.allreduce([torch.ones(2)], keep_inputs=False)
    with pytest.raises(ValueError, match="backend"):
        LaneEngine(NoMembership(), 0, FTARConfig(backend="mpi"))


def test_no_epoch_ends_with_a_typed_error_at_the_deadline(engine: LaneEngine) -> None:
    t = torch.ones(4)
    with pytest.raises(NoEpoch):
        engine.allreduce([t]).wait(10)
    assert torch.equal(t, torch.ones(4))  # inputs untouched


def test_closed_engine_refuses_and_leaves_no_thread() -> None:
    eng = LaneEngine(NoMembership(), 3)
    eng.close()
    with pytest.raises(EngineClosed):
        eng.allreduce([torch.ones(1)]).wait(1)
    assert not [t for t in threading.enumerate() if t.name.startswith("ftar-lane3")]


def test_an_excluded_replica_fails_at_once(engine: LaneEngine) -> None:
    engine.exclude("dropped by the lighthouse")
    with pytest.raises(Excluded, match="dropped by the lighthouse"):
        engine.allreduce([torch.ones(2)]).wait(1)  # well inside epoch_wait_s: no waiting for an epoch


class QuietLighthouse(NoMembership):
    """Has epoch 3 (r0, r1) and never a newer one: the reports that would bring it were lost."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, int, bool]] = []
        self.e3 = EpochView("job", 3, (EpochMember("r0", "i", ACTIVE, 1, Endpoints()),
                                       EpochMember("r1", "i", ACTIVE, 1, Endpoints())), "x", 0.0, "")

    def current(self) -> EpochView | None:
        return self.e3

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        self.reports.append((suspect, epoch, early))


def test_while_no_newer_epoch_comes_the_last_failures_reports_are_sent_again(monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """Found by the simulator: reports sent while the lighthouse restarted were lost, and every member waited for
    an epoch nobody had asked for. The engine sends them again while it waits."""
    monkeypatch.setattr(rules, "REPORT_AGAIN_S", 0.05)
    lighthouse = QuietLighthouse()
    eng = LaneEngine(lighthouse, 0, FTARConfig(epoch_wait_s=0.6))
    try:
        eng._state.failed(3)  # an exchange failed in epoch 3 and blamed r1 (as ``_exchange`` records it)
        eng._reports.sent(rules.blame(lighthouse.e3, lighthouse.e3, "r0", ["r1"], "reset"), 3, time.monotonic())
        with pytest.raises(NoEpoch):
            eng.allreduce([torch.ones(1)]).wait(10)
    finally:
        eng.close()
    assert len(lighthouse.reports) >= 3 and set(lighthouse.reports) == {("r1", 3, False)}


def test_a_vote_lost_to_lanes_in_different_epochs_asks_for_a_reformed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the simulator: nothing failed, so nobody reported, and the redo waited above the newest epoch for
    one that never came. ``reset(reform=True)`` asks for it; a plain reset (a lane failed and blamed) does not."""
    monkeypatch.setattr(rules, "REPORT_AGAIN_S", 0.05)
    for reform, reported in ((True, True), (False, False)):
        lighthouse = QuietLighthouse()
        eng = LaneEngine(lighthouse, 0, FTARConfig(epoch_wait_s=0.3))
        try:
            eng.reset(after=3, reform=reform)
            with pytest.raises(NoEpoch):
                eng.allreduce([torch.ones(1)]).wait(10)
        finally:
            eng.close()
        assert bool(lighthouse.reports) is reported
        assert set(lighthouse.reports) <= {("r1", 3, False)}


def test_a_vote_lost_to_a_lane_that_failed_below_the_newest_epoch_asks_for_a_reformed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in ``fthsdp bench recovery --warm-restarts`` (2 of 9 runs on 2026-11-26): a joiner's epoch 3 came while
    the survivors exchanged a step; one survivor's lane 0 had begun it in epoch 2, its other lane and the other
    survivor's lanes in epoch 3. Lane 0's epoch-2 collective broke, and its report was refused as stale (the
    lighthouse was at 3). The vote (failed, newest 3) reset every lane above 3 without asking for a re-formed epoch,
    since a lane had failed; the others waited for it in epoch 3's rendezvous for 10 s before asking, and the
    survivors stalled 10.2 s. Now the ballots carry what each lane's reports ask for (``LaneEngine.asking``): none
    asks past 3, so the redo asks for a re-formed epoch 3, as with no failure at all."""
    monkeypatch.setattr(rules, "REPORT_AGAIN_S", 0.05)
    lighthouse = QuietLighthouse()
    eng = LaneEngine(lighthouse, 0, FTARConfig(epoch_wait_s=0.3))
    try:
        eng._state.failed(2)  # this lane's attempt failed in epoch 2 and blamed r1 there (a stale report)
        e2 = dataclasses.replace(lighthouse.e3, number=2)
        eng._reports.sent(rules.blame(e2, e2, "r0", ["r1"], "broken"), 2, time.monotonic())  # before 3 came
        assert eng.asking == 2
        mine, other = CommitProtocol(), CommitProtocol()
        for protocol in (mine, other):
            protocol.begin()
        mine.lane(Failed(Failure.INTERRUPTED))
        other.lane(Exchanged(3, 21))
        tally = Tally.of([mine.ballot(eng.asking), other.ballot()])
        assert (tally.failed, tally.newest, tally.asking, tally.reform) == (True, 3, 2, True)
        eng.reset(after=tally.newest, reform=tally.reform)  # as StepCore.settle does
        with pytest.raises(NoEpoch):
            eng.allreduce([torch.ones(1)]).wait(10)
    finally:
        eng.close()
    assert lighthouse.reports and set(lighthouse.reports) <= {("r1", 3, False)}
