"""The orphan-slot rule (fthsdp.runtime.orphans): who trains which micro-batch of a slot with no live holder."""

from __future__ import annotations

import random

import pytest

from fthsdp.runtime.errors import SlotConflict
from fthsdp.runtime.orphans import (
    OrphanConflict,
    Part,
    counts,
    deal,
    dealt,
    divisor_fix,
    mask,
    orphans,
    part_of,
    position,
    positions,
    read_mask,
    trained,
    weight,
)
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember


def random_membership(rng: random.Random) -> tuple[int, dict[str, int], int]:
    slots = rng.randint(1, 12)
    live = rng.sample(range(slots), rng.randint(0, slots))
    holders = {f"replica-{rng.randrange(10**6)}-{s}": s for s in live}
    return slots, holders, rng.randint(1, 5)


def test_every_part_of_every_orphan_is_dealt_exactly_once_and_evenly_for_any_membership() -> None:
    rng = random.Random(38)
    for _ in range(5000):
        slots, holders, parts = random_membership(rng)
        dealt = deal(slots, holders, parts)
        if not holders:
            assert dealt == {}
            continue
        assert set(dealt) == set(holders)
        every = [p for carried in dealt.values() for p in carried]
        assert sorted(every) == sorted(Part(o, i) for o in orphans(slots, holders) for i in range(parts))
        assert len(every) == len(set(every))
        loads = [len(c) for c in dealt.values()]
        assert max(loads) - min(loads) <= 1
        assert not any(p.slot in holders.values() for p in every)  # nobody carries a held slot
        assert sum(weight(c, parts) for c in dealt.values()) == pytest.approx(slots)
        # the step's summed mask reads back as every slot trained once
        summed = [0] * (slots * parts)
        for member, carried in dealt.items():
            for i, v in enumerate(mask(holders[member], carried, slots, parts)):
                summed[i] += int(v)
        assert trained(summed, parts, step=7) == tuple(range(slots))
        every_position = [p for m, c in dealt.items() for p in positions(holders[m], c, parts)]
        assert counts(every_position, slots, parts) == summed  # the positions a member lists are its mask's ones


def test_the_deal_depends_on_the_membership_only_not_on_the_order_members_are_listed_in() -> None:
    holders = {"c": 2, "a": 0, "b": 3}
    again = dict(sorted(holders.items()))
    assert deal(6, holders, 2) == deal(6, again, 2)
    # holders in the order of their slots, the last the larger shares, contiguous runs of the orphans' parts
    assert deal(6, holders, 2) == {
        "a": (Part(1, 0), Part(1, 1)),
        "c": (Part(4, 0), Part(4, 1)),
        "b": (Part(5, 0), Part(5, 1)),
    }
    assert deal(3, {"x": 1, "y": 2}, 3) == {"x": (Part(0, 0),), "y": (Part(0, 1), Part(0, 2))}


def test_no_orphan_no_carrying_and_one_holder_carries_every_orphan() -> None:
    assert deal(3, {"a": 0, "b": 1, "c": 2}, 4) == {"a": (), "b": (), "c": ()}
    assert deal(3, {"b": 1}, 1) == {"b": (Part(0, 0), Part(2, 0))}
    assert weight((Part(0, 0), Part(2, 0)), 1) == 3


@pytest.mark.parametrize(("slots", "holders", "parts", "why"), [
    (3, {"a": 0}, 0, "must be >= 1"),
    (3, {"a": 3}, 1, "outside 0..2"),
    (3, {"a": -1}, 1, "outside 0..2"),
    (3, {"a": 1, "b": 1}, 1, "both hold slot 1"),
])
def test_bad_membership_is_refused(slots: int, holders: dict[str, int], parts: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        deal(slots, holders, parts)


def test_a_part_trained_twice_or_a_slot_trained_in_part_is_a_conflict() -> None:
    assert position(Part(2, 1), 3) == 7
    assert trained([1, 1, 0, 0, 1, 1], 2, step=3) == (0, 2)
    with pytest.raises(OrphanConflict, match=r"step 4: slot 1's parts were trained \[2, 1\] times"):
        trained([1, 1, 2, 1], 2, step=4)
    with pytest.raises(OrphanConflict, match=r"slot 0's parts were trained \[1, 0\] times"):
        trained([1, 0, 1, 1], 2, step=4)
    with pytest.raises(ValueError, match="not a whole number of slots"):
        trained([1, 1, 1], 2, step=4)


def member(rid: str, slot: int, role: str = ACTIVE, incarnation: str = "i1") -> EpochMember:
    return EpochMember(rid, incarnation, role, 2, Endpoints(), slot)


def test_what_an_epoch_deals_a_member_counts_only_active_holders_of_its_incarnation() -> None:
    """3 slots of 2 micro-batches; replica-1 died: the epoch lists replica-0 and replica-2, so slot 1's two
    micro-batches go one to each (in slot order). A joiner's slot is an orphan until it is active; an incarnation
    the epoch does not list (a dead process's, a restarted one not registered yet) is dealt nothing."""
    both = (member("replica-0", 0), member("replica-2", 2))
    assert dealt(both, "replica-0", "i1", 3, 2) == (0, 1, 2)  # its slot's parts, then slot 1's first
    assert dealt(both, "replica-2", "i1", 3, 2) == (3, 4, 5)
    assert dealt(both, "replica-2", "i0", 3, 2) == ()
    assert dealt(both, "replica-1", "i1", 3, 2) == ()
    joining = (*both, member("replica-1", 1, role=JOINING))
    assert dealt(joining, "replica-0", "i1", 3, 2) == (0, 1, 2) and dealt(joining, "replica-1", "i1", 3, 2) == ()
    whole = (member("replica-0", 0), member("replica-1", 1), member("replica-2", 2))
    assert [dealt(whole, f"replica-{r}", "i1", 3, 2) for r in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert [part_of(p, 2) for p in (0, 1, 2, 5)] == [Part(0, 0), Part(0, 1), Part(1, 0), Part(2, 1)]


def test_the_mask_with_orphans_carried_names_the_holders_and_the_slots_trained_and_the_divisor() -> None:
    """Two contributors (slots 0 and 2) trained slot 1 between them: the holders are 0 and 2, every slot was
    trained, and the gradients averaged over 2 contributors are scaled by 2/3 to be the mean over 3 slots."""
    slots, parts, c = 3, 2, 2
    own = [0.5, 0.0, 0.5]  # averaged: 1/contributors at each holder's slot
    by_part = [x / c for x in counts([0, 1, 2, 3, 4, 5], slots, parts)]
    assert read_mask(own + by_part, c, slots, parts, step=4) == ((0, 2), (0, 1, 2))
    assert divisor_fix(own + by_part, c, slots, parts, step=4) == 2 / 3
    lost = [x / c for x in counts([0, 1, 4, 5], slots, parts)]  # nobody carried slot 1: it waits, 1 per slot
    assert read_mask(own + lost, c, slots, parts, step=4) == ((0, 2), (0, 2)) and divisor_fix(own + lost, c, slots,
                                                                                                 parts, step=4) == 1
    with pytest.raises(OrphanConflict, match="step 4: slot 1"):  # a part trained twice: nothing commits
        read_mask(own + [x / c for x in counts([0, 1, 2, 2, 3, 4, 5], slots, parts)], c, slots, parts, step=4)
    with pytest.raises(SlotConflict):
        read_mask([0.5, 0.5, 0.5] + by_part, c, slots, parts, step=4)
    with pytest.raises(ValueError, match="FTHSDP_MICRO_BATCHES"):
        read_mask(own + by_part, c, slots, 3, step=4)
    assert divisor_fix([0.0] * 9, 0, slots, parts, step=4) == 1  # nobody contributed: nothing to scale
