"""The end-of-job barrier through the replica-local vote (``fthsdp.runtime.ending``), with the lane and the other
rank as fakes: a barrier split across ranks is redone by both, above the epoch it went in; the rounds are bounded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftar import ExchangeResult, Interrupted
from fthsdp.runtime import ending
from fthsdp.runtime.commit import Ballot, CommitProtocol, Tally


class Done:
    def __init__(self, outcome: ExchangeResult | Exception) -> None:
        self.outcome = outcome

    def wait(self, timeout: float) -> ExchangeResult:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class Lane:
    """This rank's barrier exchanges, one outcome per round, and the engine's resets."""

    def __init__(self, outcomes: list[ExchangeResult | Exception]) -> None:
        self.outcomes = outcomes
        self.resets: list[int] = []

    def barrier(self, step: int, again: bool = False) -> Done:
        return Done(self.outcomes.pop(0))

    def reset(self, after: int = 0, reform: bool = False) -> None:
        self.resets.append(after)


def ok(epoch: int) -> ExchangeResult:
    return ExchangeResult([], epoch, 0, 1, 50)


def other_rank(ballots: list[Ballot]) -> Callable[[CommitProtocol], Tally]:
    """The vote with the replica's other rank, whose ballot per round is given."""
    return lambda protocol: Tally.of([protocol.ballot(), ballots.pop(0)])


def test_a_barrier_split_across_ranks_is_redone_by_both_above_its_epoch() -> None:
    lane = Lane([ok(7), ok(8)])  # this rank completed it in epoch 7; the other rank's lane lost it
    vote = other_rank([Ballot(True, 0, 0, -1, False), Ballot(False, 8, 8, 12, False)])
    logs: list[Any] = []
    assert ending.barrier(lane, lane, 12, vote, 1.0, lambda *a: logs.append(a))  # type: ignore[arg-type]
    assert lane.resets == [7] and lane.outcomes == []  # redone once, above epoch 7, then committed


def test_the_barrier_gives_up_after_its_rounds_and_says_so() -> None:
    lane = Lane([Interrupted("lost", 3)] * ending.END_ATTEMPTS)
    vote = other_rank([Ballot(False, 3, 3, 12, False)] * ending.END_ATTEMPTS)
    logs: list[Any] = []
    assert not ending.barrier(lane, lane, 12, vote, 1.0, lambda *a: logs.append(a))  # type: ignore[arg-type]
    assert len(lane.resets) == ending.END_ATTEMPTS - 1 and lane.outcomes == []
    assert any("leaving anyway" in str(a[1]) for a in logs)
