"""Orphan slots: who trains the batch of a data slot that has no live holder (docs/design.md §7, "Orphan slots").
Pure: the same answer on every member from the same epoch, no network.

A job has ``slots`` data slots; a step trains one batch of each, ``parts`` micro-batches per slot (the trainer's
gradient accumulation). A slot whose replica is dead and that no spare took is an **orphan**. For the global batch
to stay constant, the replicas that hold a slot (the **holders**) train the orphans' micro-batches too, as extra
micro-batches accumulated into their contribution: the orphans' micro-batches (``Part``: slot, micro-batch), in
slot order, are dealt out in contiguous runs to the holders in the order of their slots, each holder
``floor(U / H)`` or ``ceil(U / H)`` of the ``U`` parts, the last holders the larger share. So every part of every
orphan is trained by exactly one holder while one holder lives, and no holder trains more than one part beyond
another. A holder's contribution then weighs ``1 + len(parts) / parts`` slots, the divisor of the step is the
number of slots trained, and no learning-rate compensation is needed.

The exchange's slot mask has one position per part (``position``): the holder of a slot writes its own slot's
``parts`` positions, a carrier the positions of what it carried. ``trained`` reads the summed mask back: the
slots every part of which was trained exactly once, and ``OrphanConflict`` for a part trained twice or a slot
trained in part.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from fthsdp.runtime.commit import contributing_slots
from lighthouse.model import EpochMember, holders_of


class OrphanConflict(ValueError):
    """A step's summed slot mask is not a whole number of slots each trained once: two members trained one part
    (they disagreed on the membership the parts were dealt from), or a slot was trained only in part."""


class Part(NamedTuple):
    """One micro-batch of a slot's step batch."""

    slot: int
    micro: int


def orphans(slots: int, holders: Mapping[str, int]) -> tuple[int, ...]:
    """The slots of ``slots`` that no holder in ``holders`` (member id → its slot) holds, in order."""
    held = set(holders.values())
    return tuple(s for s in range(slots) if s not in held)


def deal(slots: int, holders: Mapping[str, int], parts: int) -> dict[str, tuple[Part, ...]]:
    """Which orphan parts each holder of ``holders`` (member id → the slot it holds) trains this step, besides its
    own slot's ``parts`` micro-batches (module docstring). Every holder is a key (with ``()`` when it carries
    nothing); no holders: ``{}`` (nobody trains; the job waits for one). Raises ``ValueError`` for ``parts < 1``, a
    slot outside ``0..slots-1`` or two holders of one slot."""
    if parts < 1:
        raise ValueError(f"parts (micro-batches per slot and step) must be >= 1, got {parts}")
    seen: dict[int, str] = {}
    for member, slot in holders.items():
        if not 0 <= slot < slots:
            raise ValueError(f"{member} holds slot {slot}, outside 0..{slots - 1}")
        if slot in seen:
            raise ValueError(f"{seen[slot]} and {member} both hold slot {slot}")
        seen[slot] = member
    order = [seen[s] for s in sorted(seen)]
    units = [Part(o, i) for o in orphans(slots, holders) for i in range(parts)]
    n = len(order)
    return {member: tuple(units[k * len(units) // n:(k + 1) * len(units) // n]) for k, member in enumerate(order)}


def dealt(members: Iterable[EpochMember], replica_id: str, incarnation: str, slots: int, parts: int) \
        -> tuple[int, ...]:
    """The slot mask's positions an epoch whose ``members`` these are deals the member ``replica_id`` (this
    ``incarnation`` of it): as an active holder of a slot there, its slot's ``parts`` micro-batches and its share of
    the orphans' (``deal``); else none (a joiner, a spare, an incarnation the epoch does not list: its slot, if any,
    is an orphan there)."""
    members = tuple(members)
    holders = dict(holders_of(members))
    me = next((x for x in members if x.replica_id == replica_id), None)
    if me is None or me.incarnation != incarnation or replica_id not in holders:
        return ()
    return positions(holders[replica_id], deal(slots, holders, parts)[replica_id], parts)


def part_of(position: int, parts: int) -> Part:
    """The part at slot-mask position ``position`` (``position``'s inverse)."""
    return Part(*divmod(position, parts))


def weight(carried: Sequence[Part], parts: int) -> float:
    """How many slots a holder's contribution stands for: its own slot and ``carried`` (micro-batches of
    ``parts`` per slot)."""
    return 1 + len(carried) / parts


def position(part: Part, parts: int) -> int:
    """The slot mask's position of ``part`` (``slots * parts`` positions in all)."""
    return part.slot * parts + part.micro


def positions(slot: int, carried: Sequence[Part], parts: int) -> tuple[int, ...]:
    """The slot mask's positions a holder trains, in order: every part of its ``slot`` and ``carried``."""
    return tuple(sorted(position(p, parts) for p in [*(Part(slot, i) for i in range(parts)), *carried]))


def mask(slot: int, carried: Sequence[Part], slots: int, parts: int) -> list[float]:
    """A holder's slot mask: 1 at each part it trained (``positions``), 0 elsewhere."""
    out = [0.0] * (slots * parts)
    for p in positions(slot, carried, parts):
        out[p] = 1.0
    return out


def counts(trained_positions: Sequence[int], slots: int, parts: int) -> list[int]:
    """The summed slot mask as counts, from every position the members trained (one entry per member and part)."""
    out = [0] * (slots * parts)
    for p in trained_positions:
        out[p] += 1
    return out


def trained(counts: Sequence[int], parts: int, step: int) -> tuple[int, ...]:
    """The slots trained in ``step``, from the summed slot mask ``counts`` (how many members trained each part):
    every part of a slot once. Raises ``OrphanConflict`` for a part trained more than once or a slot trained only
    in part (nothing is committed from such a step)."""
    if parts < 1 or len(counts) % parts:
        raise ValueError(f"a mask of {len(counts)} positions is not a whole number of slots of {parts} parts")
    out = []
    for slot in range(len(counts) // parts):
        mine = counts[slot * parts:(slot + 1) * parts]
        if any(c not in (0, 1) for c in mine) or 0 < sum(mine) < parts:
            raise OrphanConflict(f"step {step}: slot {slot}'s parts were trained {list(mine)} times: each part must "
                                 "be trained exactly once, or the slot not at all")
        if sum(mine) == parts:
            out.append(slot)
    return tuple(out)


def read_mask(mask: Sequence[float], contributors: int, slots: int, parts: int, step: int) \
        -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A step's averaged slot mask with orphan slots carried (``fthsdp.runtime.bucket_plan.slot_mask``: ``slots``
    positions of the holders' own slots, then ``slots * parts`` of the parts trained): (the slots whose holders
    contributed, ``commit.contributing_slots``; the slots trained, ``trained``). Raises ``SlotConflict`` or
    ``OrphanConflict``."""
    if len(mask) != slots + slots * parts:
        raise ValueError(f"a mask of {len(mask)} positions for {slots} slots of {parts} parts: the replicas disagree "
                         "on FTHSDP_NUM_REPLICAS or FTHSDP_MICRO_BATCHES")
    held = contributing_slots(mask[:slots], contributors, step)
    return held, trained([round(x * contributors) for x in mask[slots:]], parts, step)


def slots_trained(mask: Sequence[float], contributors: int, slots: int, parts: int, step: int) -> int:
    """How many slots' batches a step trained: its contributors when nothing is carried (``parts`` 0), else the
    slots whose every part was trained (``read_mask``)."""
    if not parts or contributors == 0:
        return contributors
    return len(read_mask(mask, contributors, slots, parts, step)[1])


def divisor_fix(mask: Sequence[float], contributors: int, slots: int, parts: int, step: int) -> float:
    """What the step's gradients, averaged over its ``contributors``, are multiplied by to be averaged over the slots
    it trained (``slots_trained``): ``contributors / trained``, 1 when nothing was carried (and with no
    contributor)."""
    done = slots_trained(mask, contributors, slots, parts, step)
    return contributors / done if done else 1.0
