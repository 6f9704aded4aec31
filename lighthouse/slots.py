"""Data slots and spares (docs/design.md §7, "Spares"): which member trains which slot of the job's data,
decided by the lighthouse and listed in every epoch. Pure functions over the membership state.

A job has ``slots`` data slots (``FTHSDP_NUM_REPLICAS``); each slot's data cursor belongs to the job, and a member
holds a slot while it is live. A member without one is a **spare**: it is in the data plane, exchanges zeros and
applies every update, so it holds the same state as the others, bitwise, at every commit, and computes nothing.

- A registrant asks for a slot (its ``FTHSDP_REPLICA_INDEX``) or for none (a spare); it holds none until it is
  in the data plane (the first epoch, or its ``Ready(JOINING)``).
- A member that dies or leaves frees its slot. Whenever an epoch forms, the free slots go to the members in the
  data plane that hold none: first each to the member that asked for it, then the rest to the others, active
  ones first (a spare, current: it contributes from its next step), by replica id. So the first epoch, or a
  resume after every replica died, gives every replica the slot it asked for; a killed replica's slot is handed
  to a spare in the epoch that drops it (the killed replica is not in the data plane again yet); and the killed
  replica, back, comes in as a spare (or gets its slot back, if no spare took it).
- Two members never hold one slot in an epoch. A member trains the slot its newest epoch gives it when a step
  begins, and exchanges that step only in that epoch or a newer one, where the slot's previous holder is no
  longer a member: so no step has two contributions for one slot (the runtime checks it too,
  ``fthsdp.runtime.commit.contributing_slots``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from lighthouse.model import ACTIVE, NO_SLOT, Member, State, holders_of


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
    """``state`` with every free slot handed to a member in the data plane that holds none: the slot it asked
    for, else any free one (active members first, then by replica id); the same object when nothing changes."""
    if not state.slots:
        return state
    held = {m.slot for m in state.members.values() if m.slot != NO_SLOT}
    if len(held) >= state.slots:
        return state
    order = sorted((m for m in state.members.values() if m.slot == NO_SLOT and m.in_epoch),
                   key=lambda m: (m.role != ACTIVE, m.replica_id))
    free = [s for s in range(state.slots) if s not in held]
    changed: dict[str, Member] = {}
    for m in order:  # first the slot each asked for
        if m.asks in free:
            free.remove(m.asks)
            changed[m.replica_id] = dataclasses.replace(m, slot=m.asks)
    for m, slot in zip((m for m in order if m.replica_id not in changed), list(free), strict=False):
        changed[m.replica_id] = dataclasses.replace(m, slot=slot)
    if not changed:
        return state
    new = dataclasses.replace(state, members={**state.members, **changed})
    if (known := state.known_in_epoch_count()) is not None:
        new.seed_in_epoch_count(known)  # the same members in the data plane
    return new


def waiting_slots(state: State) -> tuple[int, ...]:
    """The job's data slots that no active member of the current epoch holds, in order: their batches wait until a
    holder (a restarted replica, once active, or a spare) takes the slot (docs/design.md §7). None before the
    first epoch, after the job finished, or in a job that names no slots."""
    if state.epoch is None or state.finished_step is not None or not state.slots:
        return ()
    held = {slot for _, slot in holders_of(state.epoch.members)}
    return tuple(k for k in range(state.slots) if k not in held)


@dataclasses.dataclass
class OrphanSteps:
    """Per data slot, the job's steps during which no active member held it (an orphan: carried by the others with
    ``Policy.orphan_planes``, else its batches waited), as the lighthouse sees them: the highest step the members'
    heartbeats reported when the slot lost its holder and when it got one back (so within about a heartbeat
    interval; the run's report counts them exactly, from the step rows). Informational: soft state, not stored."""

    opened: dict[int, int] = dataclasses.field(default_factory=dict)
    """slot -> the job's step when it became an orphan (still one)."""
    closed: dict[int, int] = dataclasses.field(default_factory=dict)
    """slot -> the steps it was an orphan in the spells that ended."""

    def observe(self, orphans: Collection[int], step: int) -> None:
        """A new epoch, in which ``orphans`` are the slots without an active holder, at the job's ``step``."""
        for slot in [s for s in self.opened if s not in orphans]:
            self.closed[slot] = self.closed.get(slot, 0) + max(0, step - self.opened.pop(slot))
        for slot in orphans:
            self.opened.setdefault(slot, step)

    def counts(self, step: int) -> dict[int, int]:
        """Per slot that was an orphan for at least one step, the steps it was one, up to the job's ``step``."""
        out = dict(self.closed)
        for slot, since in self.opened.items():
            out[slot] = out.get(slot, 0) + max(0, step - since)
        return {k: n for k, n in sorted(out.items()) if n > 0}
