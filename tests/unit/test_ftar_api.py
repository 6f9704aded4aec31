"""FTAR engine argument checks and lifecycle, without a network (a membership that never has an epoch)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from ftar import EngineClosed, Excluded, FTARConfig, LaneEngine, NoEpoch
from lighthouse.epoch_view import EpochView


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
