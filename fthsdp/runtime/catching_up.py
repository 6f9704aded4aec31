"""A joiner's steps (docs/design.md §6), driven from ``Replica.train_step``: exchange zeros step after step while
the snapshot is fetched, then load it and replay the kept steps — still exchanging zeros, a slice per step — and
turn active, with one more zero step after that (with orphan slots carried, the lighthouse is told it is active
only after that zero step: ``roles.CaughtUp``).

A snapshot that comes in while a step's zeros are in flight is loaded and checked then (``Joiner.early``), and that
step's results replayed on top once its exchange settles. Every step's zeros go out *before* that step's share of
the load and replay: the others compute the step meanwhile, so they wait for nothing as long as a slice takes less
than their step. The first slice loads and checks the snapshot; the others replay kept steps for about half of the
others' step (measured here, as the time between two exchanges while fetching), at least two each, so the backlog
shrinks by at least one per step (replaying a step is an optimizer step, cheaper than training one). A replay of
many kept steps after a slow fetch used to run in one go, and the others waited for all of it in their next
exchange.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from ftar import Handle
from fthsdp.catchup.client import FetchResult
from fthsdp.runtime.commit import Tally
from fthsdp.runtime.core import StepCore
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.standing import Standing
from fthsdp.runtime.startup import all_ranks
from fthsdp.runtime.state import ShardState
from lighthouse.model import NO_SLOT

SLICE_SHARE = 0.5
"""A replay slice's budget: this share of the others' step."""
MIN_SLICE = 2
"""Kept steps a slice replays at least (while any are left)."""


class Slotted(Protocol):
    """What ``lent_slot`` uses of a replica: its data slot (``NO_SLOT``: a spare)."""

    slot: int


@contextlib.contextmanager
def lent_slot(rep: Slotted) -> Iterator[None]:
    """Meanwhile a replica with no data slot (a spare) reads as slot 0's (``slot``, ``cursor``), for a warm-up's
    forward and backward, whose result is thrown away: the trainer's closure reads its slot's batch, and a spare has
    none. It consumes no data (no cursor moves without a commit)."""
    if rep.slot != NO_SLOT:
        yield
        return
    rep.slot = 0
    try:
        yield
    finally:
        rep.slot = NO_SLOT


def catch_up(rep: StepCore, closure: Callable[[], torch.Tensor] | None) -> tuple[StepResult, list[Handle | None]]:
    """Catch up (one ``train_step`` call, or in the trainer's loop one ``zero_grad``, whose warm-up was the loop's
    iteration before: ``closure`` None): returns the joined step's result once this replica holds the same state
    as the others (a member from then on: the commit boundary's duties are a member's), and the next step's zeros,
    in flight (``roles.CaughtUp``)."""
    t_start = time.perf_counter()
    shards, _ = rep.parts()
    with lent_slot(rep):  # a spare group's restart warms up too
        entered = rep.joiner.enter(shards.opt, closure, shards.layout())
    handles = rep.exchange_all(contribute=False, learned_at=rep.joiner.fetch_from)  # the fetch starts at once
    got, intervals, t_in, replayed, at = None, [], 0.0, 0, -1
    t_last = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        commit, results = rep.settle(handles, contribute=False)
        rep.step, rep.learned = commit.step + 1, commit.step
        if got is None:
            intervals.append(time.perf_counter() - t_last)
            got = rep.joiner.exchanged(commit.step, results, commit.attempts)
            if got is None:
                handles, t_last = rep.exchange_all(contribute=False), time.perf_counter()
                # The snapshot often comes in while this step's exchange waits for the others' compute: load it
                # then, and the exchange's results are replayed on top once it settles.
                got = rep.joiner.early(functools.partial(_all_done, handles))
                if got is not None:
                    t_in, exchanging = time.perf_counter(), rep.step
                    at, rep.step = _load(rep, shards, got), exchanging
                continue
            t_in = time.perf_counter()
        else:
            rep.joiner.keep(commit.step, results, commit.attempts)
        handles = rep.exchange_all(contribute=False)  # the next step's zeros first: the others need not wait
        exchanging = rep.step
        first = at < 0
        if first:  # the first slice: load the snapshot and check it
            at = _load(rep, shards, got)
        rep.step = at
        budget = SLICE_SHARE * statistics.median(intervals[-5:])
        replayed += rep.joiner.replay_slice(commit.step, rep.commit, budget, 0 if first else MIN_SLICE)
        at, rep.step = rep.step, exchanging  # the state is at step ``at``; the exchanges go on at ``exchanging``
        if all_ranks(at == commit.step + 1, rep.device):  # every rank holds the state after the last exchange
            break
    t_applied = time.perf_counter()
    rep.standing = Standing.MEMBER  # what the commit boundary does, it does as a member
    rep.metrics.on_joining(False)
    rep.metrics.on_catchup(got.bytes, time.perf_counter() - t_start)
    rep.metrics.on_commit(commit.step, commit.epoch, results[0].contributors, rep.joiner.attempts)
    rep.after_commit((), commit.stop)
    if not rep.config.carry_orphans:  # carrying: after the zero step (``roles.CaughtUp``), not before it
        rep.joiner.turn_active()
    catchup = rep.joiner.report(got, replayed, t_start, t_in, t_applied, entered)
    rep.log(logging.INFO, "caught up at step %d: snapshot of step %d (%.1f MB in %.3fs from %s), %d step(s) "
             "replayed in %.3fs while exchanging; now active", commit.step, got.step, got.bytes / 1e6, got.transfer_s,
             sorted(got.sources), replayed, t_applied - t_in)
    return StepResult(commit.step, None, commit.epoch, results[0].contributors, True, rep.joiner.attempts,
                      time.perf_counter() - t0, (), rep.lr_factor, catchup, contributed=False), handles


def _all_done(handles: list[Handle | None]) -> bool:
    return all(h is None or h.done() for h in handles)


def _load(rep: StepCore, shards: ShardState, got: FetchResult) -> int:
    """Load the snapshot into this rank's state and check it against the source's digest (a collective); returns
    the step of the state now held."""
    rep.cursors = shards.load(got.tensors, rep.cursors)
    rep.step = got.step
    rep.joiner.verify(got, shards.digest(rep.cursors, rng=True))
    return got.step


def zero_step(rep: StepCore, zeros: list[Handle | None], redo: Callable[[Tally], list[Handle | None]] | None = None,
              losses: list[float] | None = None, own_digest: tuple[int, bytes | None] = (-1, None)) -> StepResult:
    """The step after catching up contributes ``zeros`` (sent before the last slice of the replay) and trains no
    batch (its slot's cursor stays): its own gradients would have come late, and the others would have waited.
    A spare's step is one too, but its ``redo`` may train a slot's batch instead, appending its loss to ``losses``,
    and it holds ``own_digest`` against the slots' (``fthsdp.runtime.spares.spare_step``)."""
    t0 = time.perf_counter()
    commit, results = rep.settle(zeros, contribute=False, redo=redo)
    batches = rep.commit(commit.step, results)
    rep.check.check_own(commit.step, own_digest, results)
    rep.metrics.on_commit(commit.step, commit.epoch, results[0].contributors, commit.attempts)
    rep.after_commit(rep.held, commit.stop)
    return StepResult(commit.step, losses[0] if losses else None, commit.epoch, results[0].contributors, False,
                      commit.attempts, time.perf_counter() - t0, batches, rep.lr_factor, contributed=bool(losses),
                      slot=rep.slot if losses else None)  # a spare handed a slot in the step trained it
