"""FTAR's rules without a network: which epoch an attempt runs in, when a collective is given up, the tag check,
blame, how a failed exchange ends, the attempt limit. Scenarios drive ``ftar.rules`` the way the engine does."""

from __future__ import annotations

import pytest

from ftar import AttemptsExhausted, Excluded, FTARError, Interrupted, Misaligned, NoEpoch
from ftar.rules import (
    NO_TAG,
    REPORT_AGAIN_S,
    Attempts,
    CollectiveWatch,
    LaneState,
    PendingReports,
    Recovery,
    Verdict,
    agreed_tag,
    alignment_probe,
    blame,
    missing,
    no_epoch,
    pick_epoch,
    recovery,
)
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember

TIMEOUT_S = 5.0
GRACE_S = 1.0


def epoch(number: int, *ids: str, plane: int = 0) -> EpochView:
    members = tuple(EpochMember(rid, "inc", ACTIVE, 1, Endpoints()) for rid in ids)
    return EpochView("job", number, members, "127.0.0.1:1/rdzv", 0.0, "", plane)


def watch(e: EpochView) -> CollectiveWatch:
    return CollectiveWatch(e, 100.0, TIMEOUT_S, GRACE_S)


def reduce_max(probes: list[list[int]]) -> list[int]:
    """What the alignment all-reduce (MAX) computes from the members' probes."""
    return [max(column) for column in zip(*probes, strict=True)]


# --- scenarios ------------------------------------------------------------------------------------------------


def test_a_lane_failing_mid_step_blames_the_silent_peer_and_retries_in_the_next_epoch() -> None:
    state, attempts = LaneState("r0", lane=0), Attempts(0, 10)
    e3 = epoch(3, "r0", "r1", "r2")
    assert attempts.next() == 1
    assert state.pick(e3) is e3
    assert state.place(e3, None, new_epoch_ok=True) is e3
    # r2 hangs: the collective runs until its deadline (the data plane's own timeout, plus slack), then fails.
    w = watch(e3)
    assert w.verdict(100.0 + TIMEOUT_S, stopping=False) is Verdict.WAIT
    assert w.verdict(w.deadline, stopping=False) is Verdict.DEADLINE
    # r1 checked in as failed too, r2 did not: r2 alone is reported.
    suspects = missing(e3.replica_ids, "r0", present={1})
    assert blame(e3, e3, "r0", suspects, "deadline").suspects == ("r2",)
    # Inputs intact: redo, but not in epoch 3 again; wait until the lighthouse forms epoch 4 without r2.
    assert recovery(redo=True, keep_inputs=True, direct=False) is Recovery.REDO
    state.failed(e3.number)
    assert state.pick(e3) == 3
    e4 = epoch(4, "r0", "r1")
    assert attempts.next() == 2
    assert state.pick(e4) is e4
    assert state.place(e4, None, new_epoch_ok=True) is e4


def test_a_pushed_epoch_that_drops_a_member_abandons_the_collective_at_once() -> None:
    e3, e4 = epoch(3, "r0", "r1", "r2"), epoch(4, "r0", "r1")
    w = watch(e3)
    assert w.notice(e4, 101.0)
    assert w.verdict(101.0, stopping=False) is Verdict.ABANDON
    # The lighthouse moved on already: nobody is blamed from the old epoch.
    assert blame(e3, e4, "r0", ["r2"], "abandoned").suspects == ()


def test_an_epoch_pushed_mid_step_keeping_every_member_abandons_after_the_grace_and_retries_there() -> None:
    state = LaneState("r0", lane=0)
    e3, e4 = epoch(3, "r0", "r1"), epoch(4, "r0", "r1", "r2")  # r2 joins: a new data plane
    w = watch(e3)
    assert w.notice(e4, 101.0)
    assert not w.watching
    assert w.verdict(101.0 + GRACE_S / 2, stopping=False) is Verdict.WAIT
    assert w.verdict(101.0 + GRACE_S, stopping=False) is Verdict.ABANDON
    assert recovery(redo=True, keep_inputs=True, direct=False) is Recovery.REDO
    state.failed(e3.number)
    assert state.pick(e4) is e4


def test_a_pushed_epoch_that_keeps_the_data_plane_or_is_not_newer_changes_nothing() -> None:
    e3 = epoch(3, "r0", "r1")
    w = watch(e3)
    assert not w.notice(epoch(4, "r0", "r1", plane=3), 101.0)  # only roles changed: same group
    assert not w.notice(e3, 101.0)
    assert not w.notice(None, 101.0)
    assert w.watching
    assert w.verdict(w.deadline - 0.01, stopping=False) is Verdict.WAIT


def test_a_role_change_keeps_the_group_of_the_held_epoch() -> None:
    state = LaneState("r0", lane=0)
    e3, e4 = epoch(3, "r0", "r1"), epoch(4, "r0", "r1", plane=3)
    assert state.place(e4, e3, new_epoch_ok=True) is e3
    e5 = epoch(5, "r0", "r1")  # a re-formed epoch: a new group
    assert state.place(e5, e3, new_epoch_ok=True) is e5


def test_a_sequence_redone_after_a_vote_does_not_start_in_an_epoch_that_dropped_a_member_of_the_held_group() -> None:
    """Seen in bench recovery (5 s stall): one lane of a replica failed step t in epoch 3; its other lane, late,
    started step t in epoch 4 (which dropped the dead member) and paired there with a partner's redo, so this
    replica would redo only above epoch 4 while the partner waited for it in epoch 4."""
    e3, e4 = epoch(3, "r0", "r1", "r2"), epoch(4, "r0", "r1")
    state = LaneState("r0", lane=1)
    with pytest.raises(Interrupted) as info:
        state.place(e4, e3, new_epoch_ok=True, redo=False)
    assert info.value.epoch == 3  # interrupted in the held epoch, like the lane that failed there
    state.reset()
    assert state.place(e4, None, new_epoch_ok=True, redo=False) is e4  # the group dropped: the redo goes to e4
    # Controls: an engine that redoes by itself moves on; an epoch that only adds a member, or re-forms the same
    # members, is started in as before.
    assert LaneState("r0", lane=1).place(e4, e3, new_epoch_ok=True) is e4
    e5 = epoch(5, "r0", "r1", "r2", "r3")
    assert LaneState("r0", lane=1).place(e5, e3, new_epoch_ok=True, redo=False) is e5
    e6 = epoch(6, "r0", "r1", "r2")
    assert LaneState("r0", lane=1).place(e6, e3, new_epoch_ok=True, redo=False) is e6


def test_mid_sequence_an_exchange_stays_in_a_whole_group_and_is_interrupted_by_one_that_lost_a_member() -> None:
    state = LaneState("r0", lane=0)
    e3 = epoch(3, "r0", "r1", "r2")
    assert state.place(epoch(4, "r0", "r1", "r2", "r3"), e3, new_epoch_ok=False) is e3
    with pytest.raises(Interrupted) as info:
        state.place(epoch(5, "r0", "r1"), e3, new_epoch_ok=False)
    assert info.value.epoch == 5
    with pytest.raises(Interrupted):
        state.admit()  # every later exchange, until reset
    state.reset()
    state.admit()
    with pytest.raises(Interrupted):
        state.place(e3, None, new_epoch_ok=False)  # no group left to continue in


def test_after_a_vote_put_the_held_epoch_behind_the_redo_leaves_it_with_the_other_lanes() -> None:
    """The simulator's livelock: lane 0 completed a bucket in epoch 3 (it holds that group), lane 1 lost it; the
    vote failed and every lane was reset above epoch 3. Lane 0 must not be interrupted again by the newer epoch
    that dropped a member of its held group: it would part from lane 1, and a partner split the other way round
    would wait for it in epoch 4 while it waited for the partner, round after round."""
    e3, e4 = epoch(3, "r0", "r1", "r2"), epoch(4, "r0", "r2")
    state = LaneState("r0", lane=0)
    with pytest.raises(Interrupted):  # a step's first exchange, before any vote: interrupted in the held epoch
        state.place(e4, e3, new_epoch_ok=True, redo=False)
    state.reset()
    state.failed(3)  # the vote's reset(after=3)
    assert state.place(e4, e3, new_epoch_ok=True, redo=False) is e4


def test_a_contribution_that_does_not_fit_the_epoch_is_interrupted_and_leaves_a_group_it_exchanged_in() -> None:
    """Orphan slots carried: a contribution dealt under another membership than the epoch it lands in is
    interrupted before any data moves, and every exchange after it until the reset. Where the lane built no group
    in that epoch yet, it may come back to it (its partners wait there for its fitting contribution); where it
    already exchanged there (the step before's post exchange), its partners are past the sequence's start, so the
    lane never runs in that epoch again."""
    state, e4, e5 = LaneState("r0", lane=0), epoch(4, "r0", "r1", "r2"), epoch(5, "r0", "r2")
    err = state.misfit(e5, held=e4)
    assert isinstance(err, Interrupted) and "epoch 5" in str(err) and err.epoch == 5
    with pytest.raises(Interrupted):
        state.admit()
    state.reset()
    assert state.pick(e5) is e5  # not failed there: it comes back once it trained what e5 deals it
    state.misfit(e5, held=e5)
    state.reset()
    assert state.pick(e5) == 5  # it exchanged in e5 already: it waits for a newer epoch


def test_failure_reports_are_sent_again_until_a_newer_epoch_comes() -> None:
    """A report lost to a restarting lighthouse would leave every member waiting for an epoch nobody asked for."""
    e3 = epoch(3, "r0", "r1")
    pending = PendingReports()
    pending.sent(blame(e3, e3, "r0", ["r1"], "reset"), 3, now=10.0)
    assert pending.due(e3, 10.0 + REPORT_AGAIN_S / 2) is None
    again = pending.due(e3, 10.0 + REPORT_AGAIN_S)
    assert again is not None and again.suspects == ("r1",)
    assert pending.due(e3, 10.0 + REPORT_AGAIN_S * 1.5) is None  # not before the next interval
    assert pending.due(e3, 10.0 + REPORT_AGAIN_S * 2) is not None
    assert pending.due(epoch(4, "r0"), 100.0) is None  # the epoch came: done for good
    assert pending.due(e3, 200.0) is None
    pending.reform(e3, "r0", now=300.0)  # lanes in different epochs, nothing failed: ask for a re-formed epoch
    assert pending.due(e3, 300.0) is None
    again = pending.due(e3, 300.0 + REPORT_AGAIN_S)
    assert again is not None and again.suspects == ("r1",) and again.everyone
    assert pending.due(epoch(4, "r0", "r1"), 400.0) is None
    early = blame(e3, epoch(4, "r0", "r1"), "r0", ["r1"], "reset")  # the lighthouse had moved on already
    assert early.early
    pending.sent(early, 3, now=10.0)
    assert pending.due(e3, 100.0) is None


# --- epochs only go up ----------------------------------------------------------------------------------------


def test_a_stale_or_reused_epoch_is_refused() -> None:
    e5 = epoch(5, "r0", "r1")
    assert pick_epoch(e5, after=5, replica_id="r0") == 5
    assert pick_epoch(epoch(4, "r0", "r1"), after=5, replica_id="r0") == 5
    assert pick_epoch(None, after=5, replica_id="r0") == 5
    assert pick_epoch(epoch(6, "r0"), after=5, replica_id="r0") == epoch(6, "r0")
    state = LaneState("r0", lane=0)
    state.failed(5)
    assert state.pick(e5) == 5
    assert state.pick(e5, after=4) is e5


def test_a_replica_alone_in_its_epoch_redoes_there() -> None:
    """Alone, a failed collective (an NCCL deadline) leaves nobody to report and no newer epoch would ever form:
    the lone member redoes in the same epoch. With a partner it waits for a newer one, as before."""
    alone = epoch(5, "r0")
    assert pick_epoch(alone, after=5, replica_id="r0") is alone
    assert pick_epoch(epoch(5, "r0", "r1"), after=5, replica_id="r0") == 5
    assert pick_epoch(epoch(5, "r1"), after=5, replica_id="r0") == 5
    assert pick_epoch(alone, after=6, replica_id="r0") == 6  # an older epoch stays refused


def test_an_epoch_without_this_replica_is_skipped_and_ends_as_excluded() -> None:
    e6 = epoch(6, "r1", "r2")
    assert pick_epoch(e6, after=5, replica_id="r0") == 6  # wait above it
    assert isinstance(no_epoch(e6, 6, "r0", 30.0), Excluded)
    assert isinstance(no_epoch(None, 5, "r0", 30.0), NoEpoch)
    assert isinstance(no_epoch(epoch(5, "r0"), 5, "r0", 30.0), NoEpoch)


# --- exclusion ------------------------------------------------------------------------------------------------


def test_an_excluded_replica_fails_at_once() -> None:
    state = LaneState("r0", lane=0)
    e3 = epoch(3, "r0", "r1")
    state.exclude("dropped by the lighthouse")
    with pytest.raises(Excluded, match="dropped by the lighthouse"):
        state.pick(e3)  # even with a usable epoch at hand
    w = watch(e3)
    assert w.verdict(100.0, stopping=True) is Verdict.ABANDON  # the collective in flight ends too


# --- the tag check --------------------------------------------------------------------------------------------


def test_aligned_members_agree_and_a_joiner_learns_the_tag() -> None:
    reduced = reduce_max([alignment_probe(7), alignment_probe(7), alignment_probe(None)])
    assert agreed_tag(7, reduced, 3, 0) == 7
    assert agreed_tag(None, reduced, 3, 0) == 7
    assert alignment_probe(None) == [NO_TAG, NO_TAG]


def test_misaligned_tags_send_the_member_behind_to_catch_up_and_the_others_to_the_next_epoch() -> None:
    reduced = reduce_max([alignment_probe(7), alignment_probe(6), alignment_probe(7)])
    behind, ahead = LaneState("r1", lane=0), LaneState("r0", lane=0)
    with pytest.raises(Misaligned) as info:
        agreed_tag(6, reduced, 3, 0)
    assert (info.value.tag, info.value.lowest, info.value.highest) == (6, 6, 7)
    with pytest.raises(Misaligned):
        behind.misaligned(3, info.value)
    with pytest.raises(Misaligned) as info:
        agreed_tag(7, reduced, 3, 0)
    ahead.misaligned(3, info.value)
    assert ahead.pick(epoch(3, "r0", "r1")) == 3  # waits for the next epoch
    # A joiner does not check the others' agreement: it only learns the highest tag.
    assert agreed_tag(None, reduced, 3, 0) == 7


def test_a_lane_of_joiners_only_is_an_error() -> None:
    with pytest.raises(FTARError, match="nobody knows the step"):
        agreed_tag(None, reduce_max([alignment_probe(None), alignment_probe(None)]), 3, 0)


# --- blame ----------------------------------------------------------------------------------------------------


def test_blame_picks_exactly_the_members_whose_keys_are_missing() -> None:
    ids = ("r0", "r1", "r2", "r3")
    assert missing(ids, "r1", present={0, 3}) == ["r2"]
    assert missing(ids, "r1", present=set()) == ["r0", "r2", "r3"]
    assert missing(ids, "r1", present={0, 2, 3}) == []
    assert missing(ids, "r1", present=None) == []  # the store cannot be read: nobody can be blamed from here
    e = epoch(3, *ids)
    verdict = blame(e, e, "r1", ["r0", "r3"], "deadline")
    assert verdict.suspects == ("r0", "r3") and verdict.reason == "deadline" and not verdict.everyone


def test_a_failure_with_everyone_checked_in_reports_every_other_member_for_a_re_formed_epoch() -> None:
    e = epoch(3, "r0", "r1", "r2")
    verdict = blame(e, e, "r1", [], "collective error")
    assert verdict.suspects == ("r0", "r2")
    assert verdict.everyone and verdict.reason == "nobody to blame: collective error"


# --- how a failed exchange ends, and how often it is tried ------------------------------------------------------


def test_recovery_after_a_failed_attempt() -> None:
    assert recovery(redo=False, keep_inputs=True, direct=False) is Recovery.INTERRUPT
    assert recovery(redo=True, keep_inputs=False, direct=True) is Recovery.RECOMPUTE
    assert recovery(redo=False, keep_inputs=False, direct=True) is Recovery.RECOMPUTE
    assert recovery(redo=True, keep_inputs=False, direct=False) is Recovery.REDO  # reduced a private copy
    state = LaneState("r0", lane=2)
    error = state.interrupt(4)
    assert isinstance(error, Interrupted) and error.epoch == 4
    with pytest.raises(Interrupted, match="reset"):
        state.admit()


def test_attempts_are_limited() -> None:
    attempts = Attempts(lane=1, max_attempts=3)
    assert [attempts.next() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(AttemptsExhausted, match="3 epochs"):
        attempts.next()
    with pytest.raises(AttemptsExhausted):
        Attempts(lane=1, max_attempts=0).next()
