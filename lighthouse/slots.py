"""Data slots and spares (docs/design.md §8.4): which member trains which slot of the job's data, decided by the
lighthouse and listed in every epoch. Pure functions over the membership state.

A job has ``slots`` data slots (``FTHSDP_NUM_REPLICAS``); each slot's data cursor belongs to the job, and a member
holds a slot while it is live. A member without one is a **spare**: it is in the data plane, exchanges zeros and
applies every update, so it holds the same state as the others, bitwise, at every commit, and computes nothing.

- A registrant asks for a slot (its ``FTHSDP_REPLICA_INDEX``) or for none (a spare); it holds none until it is
  in the data plane (the first epoch, or its ``Ready(JOINING)``).
- A member that dies or leaves frees its slot. Whenever an epoch forms, each free slot goes to a member in the
  data plane that holds none: an active one first (a spare, current: it contributes from its next step), then
  the one that asked for that slot, then any, by replica id. So the first epoch gives every replica the slot it
  asked for; a killed replica's slot is handed to a spare in the epoch that drops it; and the killed replica,
  back, comes in as a spare (or gets its slot back, if no spare took it).
- Two members never hold one slot in an epoch. A member trains the slot its newest epoch gives it when a step
  begins, and exchanges that step only in that epoch or a newer one, where the slot's previous holder is no
  longer a member: so no step has two contributions for one slot (the runtime checks it too,
  ``fthsdp.runtime.commit.contributing_slots``).
"""

from __future__ import annotations

import dataclasses

from lighthouse.model import ACTIVE, NO_SLOT, Member, State


def check(state: State, slot: int, slots: int) -> str | None:
    """Why a registration asking for ``slot`` of ``slots`` is refused (None: it is not). ``slots == 0``: the
    registrant names no slots (a client that does not use them): it asks for none."""
    if slots < 0 or slots > 1_000_000:
        return f"slots must be in 0..1000000, got {slots}"
    if slots and state.slots and slots != state.slots:
        return f"the job has {state.slots} data slots, this replica says {slots} (FTHSDP_NUM_REPLICAS differs)"
    if slots and not NO_SLOT <= slot < slots:
        return f"slot {slot} is outside 0..{slots - 1} (or {NO_SLOT}: none, a spare)"
    return None


def assign(state: State) -> State:
    """``state`` with every free slot handed to a member in the data plane that holds none (active first, then
    the one that asked for it, then by replica id); the same object when nothing changes."""
    if not state.slots:
        return state
    held = {m.slot for m in state.members.values() if m.slot != NO_SLOT}
    if len(held) >= state.slots:
        return state
    takers = [m for m in state.members.values() if m.slot == NO_SLOT and m.in_epoch]
    changed: dict[str, Member] = {}
    for slot in range(state.slots):
        if not takers:
            break
        if slot in held:
            continue
        taker = min(takers, key=lambda m: (m.role != ACTIVE, m.asks != slot, m.replica_id))
        takers.remove(taker)
        changed[taker.replica_id] = dataclasses.replace(taker, slot=slot)
    if not changed:
        return state
    new = dataclasses.replace(state, members={**state.members, **changed})
    if (known := state.known_in_epoch_count()) is not None:
        new.seed_in_epoch_count(known)  # the same members in the data plane
    return new
