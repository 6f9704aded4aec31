"""``train_step(closure)`` with orphan slots carried (``fthsdp.runtime.closure.ClosureSteps._carrying_step``): the
trainer's-loop iteration driven for the closure, on a fake of the iteration's three calls (``begin``, ``dealt``,
``finish``); the real ones are tested with processes in tests/integration/test_orphans.py."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fthsdp.runtime.closure import ClosureSteps
from fthsdp.runtime.config import ConfigError, RuntimeConfig
from fthsdp.runtime.result import StepResult


def _result(step: int, contributed: bool = True) -> StepResult:
    return StepResult(step, None, 1, 3, False, 1, 0.0, (), 1.0, contributed=contributed)


class FakeIteration:
    """``begin`` commits a catch-up and a zero step (delivered, as ``Steps.deliver`` does) before the first trained
    iteration; the first ``finish`` of step 5 is a redeal (None), the second commits it with a new deal."""

    def __init__(self, steps: Any) -> None:
        self.steps, self.begins, self.finishes = steps, 0, 0
        self.deals = [((1, 5, 0), (2, 5, 0)), ((1, 5, 0),)]

    def begin(self) -> bool:
        self.begins += 1
        if self.begins == 1:
            self.steps._results.extend([_result(3, False), _result(4, False)])
        self.steps._iter = object()
        return True

    def dealt(self) -> Iterator[tuple[int, int, int]]:
        yield from self.deals[min(self.finishes, 1)]

    def finish(self) -> StepResult | None:
        self.finishes += 1
        self.steps._iter = None
        return None if self.finishes == 1 else _result(5)


def _steps(micro_batches: int = 1) -> tuple[Any, FakeIteration]:
    steps: Any = object.__new__(ClosureSteps)
    steps.config = RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=0, num_replicas=3, replica_id="r0", rank=0,
                                 world_size=1, carry_orphans=True, micro_batches=micro_batches)
    steps._queued, steps._results, steps._iter, steps.slot = deque(), deque([_result(2)]), None, 1
    fake = FakeIteration(steps)
    steps.begin, steps.dealt, steps.finish = fake.begin, fake.dealt, fake.finish
    return steps, fake


def test_each_call_returns_one_committed_step_and_the_closure_reads_each_dealt_slot() -> None:
    steps, fake = _steps()
    w = torch.ones((), requires_grad=True)
    seen: list[int] = []

    def closure() -> torch.Tensor:
        seen.append(steps.slot)
        return w * (10.0 + steps.slot)

    got = [steps.train_step(closure) for _ in range(3)]
    assert [r.step for r in got] == [3, 4, 5]  # the catch-up and the zero step first, in order, then the trained one
    assert seen == [1, 2, 1]  # slot 2 carried, then dealt anew (the step trained again: a redeal)
    assert steps.slot == 1  # its own slot once the closure returned
    assert got[2].loss == 11.0  # this rank's mean over the batches of the committed iteration
    assert w.grad is not None and float(w.grad) == 11 + 12 + 11  # a backward per batch computed
    assert fake.begins == 2 and fake.finishes == 2
    assert got[:2] == list(steps._results)[1:]  # the very results begin delivered


def test_micro_batches_with_train_step_and_carrying_is_a_clear_error() -> None:
    steps, fake = _steps(micro_batches=2)
    with pytest.raises(ConfigError, match="FTHSDP_MICRO_BATCHES=2 with train_step"):
        steps.train_step(lambda: torch.zeros(()))
    assert fake.begins == 0  # nothing begun
