"""The orphan-slot rule (fthsdp.runtime.orphans): who trains which micro-batch of a slot with no live holder."""

from __future__ import annotations

import random

import pytest

from fthsdp.runtime.orphans import (
    OrphanConflict,
    Part,
    counts,
    deal,
    mask,
    orphans,
    position,
    positions,
    trained,
    weight,
)


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
