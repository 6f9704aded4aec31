"""Orphan slots carried in the trainer's own loop (docs/design.md §7, "Orphan slots"; ``FTHSDP_ORPHANS=carry``).

Every iteration trains what its deal names: the replica's own slot's micro-batches and its share of the orphans'
(``fthsdp.runtime.orphans.dealt``, from an epoch). The replica's ranks must train alike (FSDP2's collectives inside
the replica pair their forward and backward passes), so rank 0 deals from the newest epoch it knows and every rank
takes its deal (``agree_deal``: one broadcast over the replica's ranks). Every bucket of the step then goes out
pinned to what it trained: FTAR exchanges it only in a group whose epoch deals this member the same (``pinned``;
``ftar.rules.LaneState.misfit``), so every part of every slot is in a group's sum exactly once. Where a newer epoch
deals otherwise before the step commits (a holder died mid-step, a joiner turned active), the step's exchange is
not redone from the gradients at hand: the iteration ends without a commit (``Redeal``) and the loop trains the
step again under the new deal. What that costs: the survivors compute the step twice once per change of holders
(the design's refinement, training only the missing micro-batches, is not built).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ftar import Handle
from fthsdp.runtime import orphans
from fthsdp.runtime.commit import Tally
from fthsdp.runtime.core import StepCore
from lighthouse.epoch_view import EpochView


class Redeal(Exception):  # noqa: N818 - a signal, not an error
    """A newer epoch deals this replica other micro-batches than its step trained: the iteration commits nothing
    and the loop trains the step again (``Steps.finish`` returns None)."""

    def __init__(self, step: int, epoch: int, trained: tuple[int, ...], dealt: tuple[int, ...]) -> None:
        super().__init__(f"step {step}: epoch {epoch} deals this replica parts {list(dealt)}, it trained "
                         f"{list(trained)}: training the step again")


def own(slot: int, parts: int) -> tuple[int, ...]:
    """The mask positions of ``slot``'s own micro-batches (what an iteration trains with nothing carried)."""
    return tuple(range(slot * parts, (slot + 1) * parts)) if slot >= 0 else tuple(range(parts))


def agree_deal(rep: StepCore, after: int = 0) -> tuple[int, int, tuple[int, ...]]:
    """(the epoch, its data plane, the mask positions it deals this replica): rank 0's newest epoch, once one is
    newer than ``after`` (waiting up to ``FTHSDP_EPOCH_WAIT``; ``after`` is the newest epoch a lane of the replica
    failed in: a redo deals from the epoch it will run in), broadcast to every rank of the replica."""
    cfg, parts, slots = rep.config, rep.config.micro_batches, rep.slots
    payload = torch.zeros(3 + slots * parts, dtype=torch.int64, device=rep.device)
    if rep.rank == 0:
        epoch = rep.feed.current()
        if after and (epoch is None or epoch.number <= after):
            epoch = rep.membership.wait_epoch(after, cfg.epoch_wait_s) or epoch
        dealt = orphans.dealt(epoch.members, cfg.replica_id, rep.incarnation, slots, parts) if epoch is not None else ()
        payload[:3] = torch.tensor([epoch.number if epoch else 0, epoch.data_plane if epoch else 0, len(dealt)])
        payload[3:3 + len(dealt)] = torch.tensor(dealt, dtype=torch.int64)
    dist.broadcast(payload, 0)
    values = payload.tolist()
    return values[0], values[1], tuple(values[3:3 + values[2]])


def redo(rep: StepCore, trained: tuple[int, ...], _tally: Tally) -> list[Handle | None]:
    """The redo of a step's exchange after a failed vote (``StepCore.settle``'s ``redo``): from the gradients at hand
    (zeros, for a step dealt nothing) if the epoch it will run in deals this replica what it ``trained``; else
    ``Redeal``."""
    epoch, _, dealt = agree_deal(rep, after=failed_epoch(rep))
    if dealt != trained:
        raise Redeal(rep.step, epoch, trained, dealt)
    return rep.exchange_all(contribute=bool(trained), redo=True)


@contextlib.contextmanager
def redealt(rep: StepCore) -> Iterator[None]:
    """Around a zero step of a replica dealt nothing (``Steps.begin``): its zeros are pinned to that deal as a
    contribution is (an epoch that deals it parts must not count them, or those parts go untrained), and a newer
    deal ends the step uncommitted, to begin again with the step before's post exchange, in the deal's plane."""
    try:
        yield
    except Redeal as e:
        rep.log(logging.WARNING, "%s", e)
        rep.parts()[1].posted = None


def failed_epoch(rep: StepCore) -> int:
    """The newest epoch a lane of this replica failed in (one MAX all-reduce over its ranks)."""
    mine = torch.tensor([rep.engine.held[1]], dtype=torch.int64, device=rep.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine.item())


def pinned(rep: StepCore, trained: tuple[int, ...]) -> Callable[[EpochView], bool]:
    """FTAR's ``fits`` for a contribution that trained the mask positions ``trained``: exchanged only in a group
    whose epoch deals this replica exactly those."""
    cfg = rep.config

    def fits(epoch: EpochView) -> bool:
        return orphans.dealt(epoch.members, cfg.replica_id, rep.incarnation, rep.slots, cfg.micro_batches) == trained

    return fits


def leave_older_plane(rep: StepCore, epoch: int, plane: int) -> bool:
    """Before a step dealt from ``epoch`` (of data plane ``plane``): whether this lane must send the step before's
    post exchange again, as its first exchange in that plane's group: it holds the group of an older plane (which
    it leaves, never to exchange in that epoch again: its partners there are past the sequence's start), or none
    (its post exchange failed: the lane is reset to exchange again)."""
    held = rep.engine.held[0]
    if held is not None and (held.data_plane == plane or held.number >= epoch):
        return False
    rep.engine.reset(after=held.number if held is not None else 0)
    if held is not None:
        rep.log(logging.INFO, "step %d dealt from epoch %d: leaving epoch %d's group for its plane", rep.step, epoch,
                held.number)
    return True
