"""Data slots on the replica side, and the spare's step (docs/design.md §7, "Spares").

The lighthouse decides which replica trains which data slot and lists it in every epoch (``lighthouse.slots``).
A replica's ranks agree on its slot through the commit vote: each rank's ballot carries the slot the newest
epoch it saw gives the replica, the tally takes the MAX (a live member's slot only goes from none to one), and
at every commit each rank takes the tally's slot for the next step. So every rank of a replica trains the same
slot in a step. A spare handed a dead replica's slot early in a step (``FTHSDP_SPARE_EARLY``: the lighthouse
learned the death at once, ``lighthouse.server.probe``) trains that slot's batch of this very step, which the dead
replica never committed, beside the others' compute (they wait for it at most about that fraction of a step,
once); handed it later (the death found by the others' failed exchange), it sends zeros in that step and
contributes from the next one.

A replica with no slot (``NO_SLOT``) is a spare: its step exchanges zeros (``contribute=False``, not counted in
the divisor), trains no batch and never calls the closure, then commits like the others, so its state equals
theirs, bitwise, at every commit; on the digest check's steps it holds its own digest against the slots'
(``DigestCheck.check_own``), and restarts if it differs. What it costs: its devices, one more member in every
exchange, one all-reduce of two integers over its own ranks per step (do they train a slot now?), and its digest
on the check's steps.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ftar import Handle
from fthsdp.runtime import catching_up
from fthsdp.runtime.commit import Tally
from fthsdp.runtime.core import StepCore
from fthsdp.runtime.join import warm_up
from fthsdp.runtime.result import StepResult
from lighthouse.model import NO_SLOT


def warm(rep: StepCore, closure: Callable[[], torch.Tensor]) -> None:
    """A spare's first step, or a warm standby's first ``train_step`` before its gate, warms up once (with
    ``FTHSDP_JOIN_WARMUP``, as a joiner does): one forward and backward, thrown away, no optimizer step (a spare's
    state must stay the others'; a standby's role is not known yet), so that the first step it trains
    a slot in is not a process's slow first one (FSDP2's lazy init, first allocations), which every member would
    wait for. The closure runs as if this replica trained slot 0 (``cursor`` and ``slot`` read as that slot's):
    like a joiner's warm-up, it must not consume data (``catching_up.lent_slot``)."""
    if rep.joiner.warmed or not rep.config.join_warmup or rep.opt is None:
        return
    with catching_up.lent_slot(rep):
        warm_up(rep.opt, closure, rep.log, optimizer_step=False)
    rep.joiner.warmed = True


@dataclass
class Shadow:
    """A spare's clock: when its current step began (its last commit as a spare) and its recent commit intervals."""

    began: float | None = None
    intervals: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=9))
    clock: Callable[[], float] | None = None
    """Seconds (None: ``time.perf_counter``; the simulator's spares run on its clock: ``fthsdp.chaos.sim.trainer``)."""

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.perf_counter()

    def committed(self) -> None:
        now = self._now()
        if self.began is not None:
            self.intervals.append(now - self.began)
        self.began = now

    def since(self) -> float:
        """Seconds since this step began (0 before the first commit)."""
        return self._now() - self.began if self.began is not None else 0.0

    def median(self) -> float | None:
        """The median of the recent commit intervals (None before two commits)."""
        return statistics.median(self.intervals) if self.intervals else None

    def early(self, fraction: float) -> bool:
        """This step began at most ``fraction`` of a median step ago (no step measured yet: no)."""
        return fraction > 0 and self.began is not None and (median := self.median()) is not None and \
            self.since() <= fraction * median


def spare_step(rep: StepCore, closure: Callable[[], torch.Tensor] | None, shadow: Shadow,
               warm_first: bool = True) -> StepResult | None:
    """A step without a slot: zeros in every bucket, then the commit as everyone's; the closure is not called (but
    once, for a warm-up: ``warm``). Unless an epoch hands this replica a slot early in the step, before the step's
    exchange or in its redo (``FTHSDP_SPARE_EARLY``, agreed by every rank): it then trains that slot's batch of this
    very step (the dead replica's, which nobody committed), beside the others' compute, so the job is back to N
    contributors in the step the death hit. The lighthouse learns a death that early from the dead replica's
    refused endpoint (``lighthouse.server.probe``).

    In the trainer's own loop (``closure`` None, ``Replica.begin``) the trainer computes the batch: a slot handed
    before the step's exchange or in its redo is taken and None returned (the loop trains it, its exchange the
    redo). ``shadow``: the spare's step clock; ``warm_first``: warm up before the first step (``roles.Spare``)."""
    if closure is not None and warm_first:
        warm(rep, closure)
    rep.faults.hold(rep.step, rep.feed, rep.log)  # FTHSDP_FAULT_HOLD_UNTIL: where the trainers hold, between steps
    shards, _ = rep.parts()
    own = rep.step, rep.check.digest(rep.step, shards, rep.cursors, rep.world_size, rep.device)  # sends none
    losses: list[float] = []

    def train(slot: int) -> list[Handle | None]:
        rep.log(logging.INFO, "data slot %d handed over in this step: training its batch", slot)
        rep.slot = slot
        assert closure is not None
        handles, loss = _train(rep, closure)
        losses.append(loss)
        return handles

    def redo(tally: Tally) -> list[Handle | None]:
        if not losses and tally.slot != NO_SLOT and (slot := _handed(rep, shadow, tally.slot)) != NO_SLOT:
            if closure is None:
                raise HandedOver(slot)
            return train(slot)
        return rep.exchange_all(contribute=bool(losses), redo=True)

    slot = _handed(rep, shadow, rep.seen_slot())
    if slot != NO_SLOT and closure is None:
        rep.log(logging.INFO, "data slot %d handed over before this step's exchange: the loop trains its batch", slot)
        rep.slot = slot
        return None
    handles = train(slot) if slot != NO_SLOT and closure is not None else rep.exchange_all(contribute=False)
    try:
        result = catching_up.zero_step(rep, handles, redo, losses, own)
    except HandedOver as h:  # the loop trains this step: its exchange is the redo (the lane was reset for it)
        rep.log(logging.INFO, "data slot %d handed over in this step's redo: the loop trains its batch", h.slot)
        rep.slot = h.slot
        rep.parts()[1].posted = None  # the redo begins with the step before's post exchange, in the new epoch
        return None
    shadow.committed()
    return result


class HandedOver(Exception):  # noqa: N818 - a signal, not an error
    """A spare in the trainer's own loop was handed a slot in a step's redo: the loop trains that very step."""

    def __init__(self, slot: int) -> None:
        super().__init__(f"handed slot {slot}")
        self.slot = slot


def _handed(rep: StepCore, shadow: Shadow, slot: int) -> int:
    """The slot every rank of this spare trains in the current step: the newest one its ranks saw, if every rank
    finds the step young enough (``Shadow.early``); else ``NO_SLOT``. One MAX all-reduce over the replica's ranks
    (the early flags ride negated, so a rank that says no wins)."""
    if rep.config.spare_early == 0:  # the same on every rank: no collective needed to agree on never
        return NO_SLOT
    early, since = shadow.early(rep.config.spare_early), shadow.since()
    mine = torch.tensor([slot, -int(early)], dtype=torch.int64, device=rep.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    agreed, all_early = int(mine[0]), -int(mine[1]) == 1
    if agreed != NO_SLOT and not all_early:  # once per hand-over: why this step sends zeros (each rank's view)
        median = shadow.median()
        rep.log(logging.INFO, "data slot %d handed over late in this step: zeros now, its batch from the next (this "
                "rank %s: %.3fs into a median %s step)", agreed, "early" if early else "late", since,
                "unmeasured" if median is None else f"{median:.3f}s")
    return agreed if all_early else NO_SLOT


def _train(rep: StepCore, closure: Callable[[], torch.Tensor]) -> tuple[list[Handle | None], float]:
    """Forward and backward of the slot's batch, the buckets going out as FSDP2 produces them (as ``train_step``)."""
    shards, buckets = rep.parts()
    shards.opt.zero_grad(set_to_none=True)
    with buckets.armed(rep.step):
        loss = closure()
        loss.backward()  # type: ignore[no-untyped-call]
    return buckets.launch_rest(rep.step), float(loss.detach().item())
