"""FTAR's step reconciliation rules (``ftar.reconcile``), pure: who serves, what a service carries, and the
crossings of lanes and replicas after a death mid-exchange."""

from __future__ import annotations

import pytest
import torch

from ftar import FTARError
from ftar.reconcile import (
    Held,
    HeldResults,
    flatten,
    header,
    holder_of,
    holder_probe,
    meta,
    needs_reconciling,
    parse,
    shaped_like,
)
from ftar.rules import NO_TAG, alignment_probe


def held(*tags: int, epoch: int = 3) -> HeldResults:
    h = HeldResults()
    for t in tags:
        h.record(t, Held((torch.full((2,), float(t)),), epoch, 3))
    return h


def holder(members: list[tuple[int | None, HeldResults]]) -> tuple[bool, int | None]:
    """What a lane's group decides: whether it looks for a holder, and which rank serves (None: nobody)."""
    probes = [alignment_probe(tag) for tag, _ in members]
    reduced = [max(col) for col in zip(*probes, strict=True)]
    highest, lowest = reduced[0], -reduced[1]
    if not needs_reconciling(highest, lowest):
        return False, None
    world = len(members)
    votes = [holder_probe(tag, highest, lowest, h, rank, world) for rank, (tag, h) in enumerate(members)]
    return True, holder_of([max(col) for col in zip(*votes, strict=True)], world)


def test_a_group_in_step_needs_no_holder() -> None:
    assert holder([(6, held(3, 4, 5)), (6, held(3, 4, 5))]) == (False, None)
    assert holder([(None, HeldResults()), (6, held())]) == (False, None)  # a joiner knows no tag
    assert not needs_reconciling(NO_TAG, -NO_TAG)  # only joiners: nobody knows the step


def test_a_replica_that_committed_serves_the_one_that_lost_a_lane() -> None:
    """Step 1 = tags 3..5. A committed it in epoch 3 and asks for tag 6; B lost a lane of it and redoes from 3."""
    a, b = held(3, 4, 5), held(0, 1, 2, 3)
    assert holder([(3, b), (6, a)]) == (True, 1)
    assert holder([(6, a), (3, b), (6, held(3, 4, 5))]) == (True, 0)  # the lowest-ranked holder


def test_a_holder_must_hold_every_result_in_between() -> None:
    assert holder([(3, held()), (6, held(4, 5))]) == (True, None)  # forgotten: the one behind must catch up
    assert holder([(0, held()), (6, held(3, 4, 5))]) == (True, None)  # two steps behind


def test_only_members_asking_for_the_highest_tag_serve() -> None:
    """A member still at the lower tag may hold results of that step from an attempt that was not committed:
    never served."""
    assert holder([(3, held(3, 4, 5)), (6, held())]) == (True, None)


def test_members_all_redoing_a_step_nobody_committed_reduce_it_afresh() -> None:
    """The lock-out of the old keep-a-lane rule: B completed the lane in epoch 3, D dropped it on the push. Both
    redo it (no lane keeps a result across a failed vote), ask for the same tag, and reduce afresh."""
    assert holder([(3, held(3, 4, 5)), (3, held(3))]) == (False, None)


def test_a_service_round_trips_bitwise_with_mixed_dtypes() -> None:
    items = [(7, Held((torch.randn(4, 3), torch.arange(5), torch.randn(2).to(torch.bfloat16)), 3, 2)),
             (8, Held((torch.randn(6),), 4, 1))]
    layout = parse(header(items), meta(items))
    got = layout.split(flatten(items, layout, torch.device("cpu")))
    assert sorted(got) == [7, 8]
    for tag, h in items:
        assert (got[tag].epoch, got[tag].contributors) == (h.epoch, h.contributors)
        out = shaped_like(got[tag], list(h.tensors), tag)
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(out, h.tensors, strict=True))


def test_a_served_result_that_does_not_fit_is_refused() -> None:
    h = Held((torch.zeros(6),), 3, 2)
    with pytest.raises(FTARError, match="does not fit"):
        shaped_like(h, [torch.zeros(5)], 7)
    with pytest.raises(FTARError, match="does not fit"):
        shaped_like(h, [torch.zeros(6, dtype=torch.float64)], 7)


def test_a_malformed_service_description_is_refused() -> None:
    items = [(7, Held((torch.zeros(2),), 3, 2))]
    with pytest.raises(FTARError, match="meta"):
        parse([1, 1], meta(items)[:-1])
    with pytest.raises(FTARError, match="dtype code"):
        parse([1, 1], [7, 3, 2, 1, 99, 2])
    with pytest.raises(FTARError, match="results name"):
        parse([1, 1], [7, 3, 2, 2, 0, 2])


def test_held_results_are_forgotten_below_a_tag() -> None:
    h = held(3, 4, 5, 6)
    h.forget_before(5)
    assert not h.covers(3, 5) and h.covers(5, 7) and len(h) == 2
    assert h.covers(5, 5)  # nothing in between


def test_every_exchange_proves_all_members_paired_the_same_tag() -> None:
    from ftar.rules import PROOF_MAX, proof_holds, tag_proof

    def summed(tags: list[int], dtype: torch.dtype = torch.float32) -> list[float]:
        # summed the way the data plane does: in the float buffer the proof rides in
        return torch.stack([torch.tensor(tag_proof(t), dtype=dtype) for t in tags]).sum(0).tolist()

    assert proof_holds(6, summed([6, 6, 6]), 3)
    assert not proof_holds(6, summed([6, 6, 9]), 3)
    assert not proof_holds(6, summed([5, 7]), 2) and not proof_holds(6, summed([5, 6, 7]), 3)  # sums alone pass
    assert not proof_holds(0x16, summed([0x15, 0x17]), 2)  # digit by digit too
    assert not proof_holds(6, summed([6, 6]), 3) and not proof_holds(6, summed([6, 6, 6]), 2)  # the count matters
    assert proof_holds(-3, summed([-3, -3]), 2) and not proof_holds(-3, summed([-3, 3]), 2)
    big = 2**62 + 12345
    assert proof_holds(big, summed([big] * 3), 3) and not proof_holds(big, summed([big, big, big + 16]), 3)
    assert max(tag_proof(2**64 - 1)) == PROOF_MAX
    world = (2**24 - 1) // PROOF_MAX  # the most members a float32 buffer carries the proof for exactly
    t = 0xFEDCBA9876543210
    assert proof_holds(t, (torch.tensor(tag_proof(t), dtype=torch.float32) * world).tolist(), world)
    assert not proof_holds(6, [x + 0.5 for x in summed([6, 6])], 2)  # a fraction is no proof


def test_a_result_changed_in_place_is_no_longer_held() -> None:
    h = HeldResults()
    t = torch.ones(3)
    h.record(4, Held((t,), 2, 1))
    assert h.covers(4, 5) and h.get(4) is not None
    t.mul_(2)  # the caller used the result in place and changed it: its bytes are not the exchange's any more
    assert not h.covers(4, 5) and h.get(4) is None
    h.record(4, Held((t,), 3, 1))  # a later exchange of the tag holds again
    assert h.covers(4, 5)
