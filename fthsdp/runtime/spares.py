"""Data slots on the replica side, and the spare's step (docs/design.md §7, "Spares").

The lighthouse decides which replica trains which data slot and lists it in every epoch (``lighthouse.slots``).
A replica's ranks agree on its slot through the commit vote: each rank's ballot carries the slot the newest
epoch it saw gives the replica, the tally takes the MAX (a live member's slot only goes from none to one), and
at every commit each rank takes the tally's slot for the next step. So every rank of a replica trains the same
slot in a step, and a spare handed a dead replica's slot in the epoch of the step's redo contributes from the
step after the failure.

A replica with no slot (``NO_SLOT``) is a spare: its step exchanges zeros (``contribute=False``, not counted in
the divisor), trains no batch and never calls the closure, then commits like the others, so its state equals
theirs, bitwise, at every commit. What it costs: its devices, and one more member in every exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from fthsdp.runtime import catching_up
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.join import warm_up
from fthsdp.runtime.result import StepResult
from lighthouse.client import LighthouseClient
from lighthouse.model import NO_SLOT


class Replica(catching_up.Replica, Protocol):
    """What the slot's hand-over and a spare's step use of ``fthsdp.runtime.replica.Replica`` (which imports this
    module): a joiner's steps' share, and the slot's holders."""

    config: RuntimeConfig
    opt: torch.optim.Optimizer | None
    slot: int


def seen(client: LighthouseClient) -> int:
    """This replica's slot in the newest epoch this rank saw (``NO_SLOT``: none, or not in it)."""
    epoch = client.epoch
    me = epoch.member(client.replica_id) if epoch is not None else None
    return me.slot if me is not None and me.incarnation == client.incarnation else NO_SLOT


def cursor(rep: Replica) -> int:
    """``Replica.cursor``: the next batch of the replica's slot."""
    if rep.slot == NO_SLOT:
        raise RuntimeError(f"replica {rep.config.replica_id} is a spare at step {rep.step}: it has no data slot, "
                           "so no batch to train (train_step does not call the closure of a spare)")
    return int(rep.cursors[rep.slot])


def warm(rep: Replica, closure: Callable[[], torch.Tensor]) -> None:
    """A spare's first step warms up once (with ``FTHSDP_JOIN_WARMUP``, as a joiner does): one forward and
    backward, thrown away, no optimizer step (its state must stay the others'), so that the first step it trains
    a slot in is not a process's slow first one (FSDP2's lazy init, first allocations), which every member would
    wait for. The closure runs as if this replica trained slot 0 (``cursor`` and ``slot`` read as that slot's):
    like a joiner's warm-up, it must not consume data."""
    if rep.joiner.warmed or not rep.config.join_warmup or rep.opt is None:
        return
    rep.slot = 0
    try:
        warm_up(rep.opt, closure, rep._log, optimizer_step=False)
    finally:
        rep.slot = NO_SLOT
    rep.joiner.warmed = True


def take(rep: Replica, slot: int) -> None:
    """Train ``slot`` from the next step on (the tally's, at a commit): the data cursor, the slot mask and the
    digest read it (``Replica.slot``)."""
    if slot == rep.slot:
        return
    rep._log(logging.INFO, "data slot %s from step %d (was %s)", "none (a spare)" if slot == NO_SLOT else slot,
             rep.step + 1, "none" if rep.slot == NO_SLOT else rep.slot)
    rep.slot = slot


def spare_step(rep: Replica, closure: Callable[[], torch.Tensor]) -> StepResult:
    """A step without a slot: zeros in every bucket, then the commit as everyone's (``catching_up.zero_step``, a
    caught-up joiner's zero step); the closure is not called (but once, for a warm-up: ``warm``)."""
    warm(rep, closure)
    return catching_up.zero_step(rep, rep._exchange_all(contribute=False))
