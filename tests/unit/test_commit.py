"""The commit protocol (fthsdp/runtime/commit.py) as a pure state machine: the ranks of one replica, each with
its lane's bucket results, vote; the decisions say commit, keep, redo or rejoin. No processes, no collectives:
the vote's all-reduce is ``Tally.of``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fthsdp.runtime.commit import (
    MAX_ATTEMPTS,
    Ballot,
    Commit,
    CommitProtocol,
    Decision,
    Exchanged,
    Failed,
    Failure,
    LaneEvent,
    Redo,
    Rejoin,
    Tally,
    advance_cursors,
    contributing_slots,
)
from fthsdp.runtime.errors import SlotConflict


def ok(epoch: int, step: int = 7) -> Exchanged:
    return Exchanged(epoch, step)


def attempt(ranks: Sequence[CommitProtocol], lanes: Sequence[Sequence[LaneEvent]]) -> list[Decision]:
    """One exchange attempt of a replica: every rank reports its lane's buckets, then the vote."""
    for p, events in zip(ranks, lanes, strict=True):
        for e in events:
            assert p.lane(e) is None
    tally = Tally.of([p.ballot() for p in ranks])
    return [p.vote(tally) for p in ranks]


def replica(n: int = 2) -> list[CommitProtocol]:
    ranks = [CommitProtocol() for _ in range(n)]
    for p in ranks:
        p.begin()
    return ranks


def test_every_lane_in_one_epoch_commits() -> None:
    ranks = replica()
    decisions = attempt(ranks, [[ok(3), ok(3), ok(3)]] * 2)
    assert decisions == [Commit(step=7, epoch=3, attempts=1, stop=False)] * 2


def test_a_lane_failing_mid_step_redoes_every_lane_and_commits_what_was_served() -> None:
    ranks = replica()
    # Rank 1's second bucket is abandoned by FTAR (a peer died): every rank's vote fails, and every lane redoes,
    # rank 0's too although it has the whole step: a partner of its lane may have lost it (no keep-a-lane rule).
    first = attempt(ranks, [[ok(3), ok(3), ok(3)], [ok(3), Failed(Failure.INTERRUPTED), Failed(Failure.NOT_SENT)]])
    assert first[0] == Redo(epochs=(3, 3, 3), failed=False) and first[0].reason == "epoch_change"
    assert first[1] == Redo(epochs=(3,), failed=True) and first[1].reason == "failure"
    # Another replica committed the step in epoch 3: in epoch 4 it serves both lanes its epoch-3 results (FTAR's
    # step reconciliation), which come back labelled with the epoch they were computed in. The vote passes and
    # commits what the other replica committed.
    second = attempt(ranks, [[ok(3), ok(3), ok(3)]] * 2)
    assert second == [Commit(step=7, epoch=3, attempts=2, stop=False)] * 2


def test_a_step_nobody_committed_is_reduced_afresh_in_the_next_epoch() -> None:
    ranks = replica()
    attempt(ranks, [[ok(3), ok(3)], [ok(3), Failed(Failure.INTERRUPTED)]])
    assert attempt(ranks, [[ok(4), ok(4)]] * 2) == [Commit(step=7, epoch=4, attempts=2, stop=False)] * 2


def test_served_lanes_and_fresh_lanes_do_not_commit_together() -> None:
    """One lane served epoch-3 results, the other reduced afresh in epoch 4 (its holder was gone): the step would
    mix two reductions (two contributor sets, two slot masks). The vote fails and both redo."""
    ranks = replica()
    attempt(ranks, [[ok(3)], [Failed(Failure.INTERRUPTED)]])
    second = attempt(ranks, [[ok(3)], [ok(4)]])
    assert second == [Redo(epochs=(3,), failed=False), Redo(epochs=(4,), failed=False)]


def test_an_epoch_pushed_mid_step_interrupts_the_later_buckets() -> None:
    """The first bucket went in epoch 5; epoch 6 arrived before the others, which stay in the epoch their
    step began in and are interrupted: the step is redone, all of it, under epoch 6."""
    ranks = replica(1)
    [d] = attempt(ranks, [[ok(5), Failed(Failure.INTERRUPTED), Failed(Failure.INTERRUPTED)]])
    assert d == Redo(epochs=(5,), failed=True)
    [d] = attempt(ranks, [[ok(6), ok(6), ok(6)]])
    assert d == Commit(step=7, epoch=6, attempts=2, stop=False)


def test_a_vote_with_mixed_epochs_fails_and_every_lane_redoes() -> None:
    """Both lanes exchanged everything, one in epoch 8, one in epoch 9 (it saw the push first): no commit, and
    both redo (the lane in the newest epoch too: a partner of it may have dropped that collective on the push)."""
    ranks = replica()
    tally = Tally.of([Ballot(False, 8, 8, 7, False), Ballot(False, 9, 9, 7, False)])
    assert not tally.passed and (tally.oldest, tally.newest) == (8, 9)
    first = attempt(ranks, [[ok(8), ok(8)], [ok(9), ok(9)]])
    assert first == [Redo(epochs=(8, 8), failed=False), Redo(epochs=(9, 9), failed=False)]
    assert attempt(ranks, [[ok(9), ok(9)], [ok(9), ok(9)]]) == [Commit(7, 9, 2, False)] * 2


def test_a_lane_whose_buckets_straddle_two_epochs_redoes() -> None:
    ranks = replica()
    first = attempt(ranks, [[ok(8), ok(9)], [ok(9), ok(9)]])
    assert first == [Redo(epochs=(8, 9), failed=False), Redo(epochs=(9, 9), failed=False)]


def test_lanes_that_disagree_on_the_step_do_not_commit() -> None:
    ranks = replica()
    first = attempt(ranks, [[ok(3, step=7)], [ok(3, step=8)]])
    assert not any(isinstance(d, Commit) for d in first)
    # Buckets of one lane under different steps: that lane has no agreed step at all.
    p = replica(1)[0]
    p.lane(ok(3, step=7))
    p.lane(ok(3, step=8))
    assert p.ballot() == Ballot(failed=True, newest=3, oldest=3, step=-1, stop=False)


def test_nothing_exchanged_votes_failed_in_epoch_zero() -> None:
    p = replica(1)[0]
    p.lane(Failed(Failure.NOT_SENT))
    assert p.ballot() == Ballot(failed=True, newest=0, oldest=0, step=-1, stop=False)


@pytest.mark.parametrize("why", [Failure.EXCLUDED, Failure.BEHIND])
def test_a_replica_excluded_or_behind_must_rejoin(why: Failure) -> None:
    p = replica(1)[0]
    assert p.lane(ok(3)) is None
    rejoin = p.lane(Failed(why))
    assert isinstance(rejoin, Rejoin)
    assert rejoin.reason == ("this replica was declared dead" if why is Failure.EXCLUDED
                             else "this replica is behind the others")


@pytest.mark.parametrize("why", [Failure.INTERRUPTED, Failure.ERROR, Failure.MISALIGNED, Failure.NOT_SENT])
def test_other_failures_are_redone(why: Failure) -> None:
    p = replica(1)[0]
    assert p.lane(Failed(why)) is None
    assert isinstance(p.vote(Tally.of([p.ballot()])), Redo)


def test_no_consistent_exchange_in_max_attempts_means_rejoin() -> None:
    ranks = replica(1)
    for n in range(1, MAX_ATTEMPTS):
        [d] = attempt(ranks, [[Failed(Failure.INTERRUPTED)]])
        assert isinstance(d, Redo), n
    [d] = attempt(ranks, [[Failed(Failure.INTERRUPTED)]])
    assert d == Rejoin(f"no consistent exchange in {MAX_ATTEMPTS} attempts")
    # The next step starts counting again.
    ranks[0].begin()
    assert attempt(ranks, [[ok(2)]]) == [Commit(7, 2, 1, False)]


def test_sigterm_rides_the_vote_and_every_rank_stops_at_the_commit() -> None:
    ranks = replica(3)
    ranks[2].sigterm()  # one rank got the signal
    first = attempt(ranks, [[ok(3)], [ok(3)], [Failed(Failure.INTERRUPTED)]])
    assert not any(isinstance(d, Commit) for d in first)  # a failed vote stops nothing
    decisions = attempt(ranks, [[ok(4)]] * 3)
    assert decisions == [Commit(7, 4, 2, stop=True)] * 3
    ranks[2].begin()  # the flag stays on the rank that got it: had the replica gone on, it would stop again
    assert attempt(ranks[2:], [[ok(4)]]) == [Commit(7, 4, 1, stop=True)]
    ranks[0].begin()
    assert attempt(ranks[:1], [[ok(4)]]) == [Commit(7, 4, 1, stop=False)]


def test_ballot_encoding_round_trips_through_a_max_reduction() -> None:
    a = Ballot(False, 4, 3, 10, False)
    b = Ballot(True, 6, 5, 12, True)
    assert Tally.decode(a.encode()) == Tally(False, 4, 3, 10, 10, False)
    assert Tally.of([a, b]) == Tally(failed=True, newest=6, oldest=3, highest_step=12, lowest_step=10, stop=True)
    c = Ballot(True, 0, 0, -1, False, asking=5)
    assert Tally.of([a, c]).asking == 5 and Tally.decode(c.encode()) == Tally(True, 0, 0, -1, -1, False, 5)
    # The slot: a rank that saw the epoch handing the replica a slot outvotes one that has not seen it yet.
    assert (Tally.of([a, c]).slot, Tally.of([a, Ballot(False, 4, 4, 10, False, slot=1)]).slot) == (-1, 1)


@pytest.mark.parametrize(("ballots", "reform"), [
    ([Ballot(False, 3, 2, 7, False), Ballot(False, 3, 3, 7, False)], True),  # lanes in different epochs, no failure
    ([Ballot(True, 0, 0, -1, False, asking=3), Ballot(False, 3, 3, 7, False)], False),  # a lane reports in 3
    ([Ballot(True, 0, 0, -1, False, asking=2), Ballot(False, 3, 3, 7, False)], True),  # only stale reports, in 2
    ([Ballot(True, 0, 0, -1, False), Ballot(False, 3, 3, 7, False)], True),  # a lane abandoned 2 for 3: no reports
])
def test_a_redo_asks_for_a_reformed_epoch_when_no_lane_asks_past_the_newest_one(ballots: list[Ballot],
                                                                                 reform: bool) -> None:
    """``Tally.reform``: a lane's failure reports bring the next epoch only if they are about the newest epoch the
    replica's buckets went in; otherwise the redo must ask (the 10 s stall of ``bench recovery --warm-restarts``)."""
    assert Tally.of(ballots).reform is reform


# --- data slots ------------------------------------------------------------------------------------------------


def test_slot_mask_names_the_contributing_slots() -> None:
    # 3 of 4 slots contributed: each shows 1/3 after averaging (float32, as exchanged).
    third = float.fromhex("0x1.555556p-2")
    assert contributing_slots([third, 0.0, third, third], 3, step=5) == (0, 2, 3)
    assert contributing_slots([1.0, 0.0], 1, step=5) == (0,)


@pytest.mark.parametrize("mask,contributors", [([1.0, 0.0], 2), ([0.5, 0.5, 0.5], 2), ([0.0, 1.0], 2)])
def test_slot_mask_that_does_not_add_up_is_a_conflict(mask: list[float], contributors: int) -> None:
    with pytest.raises(SlotConflict, match="FTHSDP_REPLICA_INDEX"):
        contributing_slots(mask, contributors, step=5)


def test_commit_advances_the_cursors_of_the_contributing_slots_only() -> None:
    cursors, batches = advance_cursors([4, 9, 2], (0, 2))
    assert cursors == [5, 9, 3]
    assert batches == ((0, 4), (2, 2))


def test_a_redo_advances_no_cursor() -> None:
    """Cursors move only with a commit: a failed vote yields no decision that carries slots, and the cursors the
    runtime holds are those of the last commit."""
    ranks = replica(1)
    cursors = [4, 9]
    [d] = attempt(ranks, [[Failed(Failure.INTERRUPTED)]])
    assert isinstance(d, Redo)
    [d] = attempt(ranks, [[ok(2)]])
    assert isinstance(d, Commit) and d.attempts == 2
    cursors, batches = advance_cursors(cursors, contributing_slots([0.5, 0.5], 2, d.step))
    assert cursors == [5, 10] and batches == ((0, 4), (1, 9))


def test_the_vote_carries_every_rank_busy_time_and_names_the_busiest() -> None:
    ballots = [Ballot(False, 3, 3, 7, False, busy_ms=b, rank=k, ranks=4) for k, b in enumerate((40, 310, 55, 310))]
    t = Tally.of(ballots)
    assert t.busy_ms == (40, 310, 55, 310) and t.passed
    assert Tally.of([Ballot(False, 3, 3, 7, False)]).busy_ms == ()  # none carried
    assert CommitProtocol().ballot(busy_ms=12, rank=1, ranks=3).encode()[-6:] == [0, 12, 0, 0, 0, 0]  # busy, lanes
    with pytest.raises(ValueError):
        Ballot(False, 3, 3, 7, False, rank=4, ranks=4).encode()
