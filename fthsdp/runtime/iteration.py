"""The two ways a trainer drives a replica's steps, both on the replica's step core (``fthsdp.runtime.core``:
settle, vote, commit, after-commit) and its role (``fthsdp.runtime.roles``: a step that trains no batch is the
role's turn):

- **its own loop** (the way documented first, ``fthsdp.runtime.loop``): ``optimizer.zero_grad()`` begins a step
  (``begin``: a joiner catches up there, a spare shadows the others there, a warm standby is released there),
  ``backward()`` exchanges the gradient shards as FSDP2 produces them and, at its end, settles and votes and binds
  the step's averaged gradients as ``.grad`` (a copy the trainer may clip); ``optimizer.step()`` commits
  (``finish``). Each iteration is an ``Iteration``.
- ``train_step(closure)`` (``fthsdp.runtime.closure``): the runtime runs forward and backward itself, one committed
  step per call.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset

from ftar import ExchangeResult
from fthsdp.runtime import carry, catching_up, grad_scale, posts, roles
from fthsdp.runtime.buckets import BucketExchange
from fthsdp.runtime.commit import Commit
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.core import StepCore
from fthsdp.runtime.faults import Phase
from fthsdp.runtime.loop import SlotLoader, data_split
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.standing import Standing
from lighthouse import membership as m

RESULTS_KEPT = 10_000
"""Step results ``pop_results`` holds at most (the oldest go first)."""


@dataclass
class Iteration:
    """One iteration of the trainer's own loop, from ``zero_grad()`` (``Replica.begin``) to ``step()``
    (``Replica.finish``)."""

    step: int
    trains: bool
    """It trains a batch of the replica's slot (else a warm-up, or a last one past the job's steps: no exchange)."""
    t0: float
    slot: int = -1
    """The data slot whose batch it trains (``trains``)."""
    cpu0: float = 0.0
    """This process's CPU time at ``t0``: its busy time in the step's compute (fail-slow evidence per rank)."""
    lent: bool = False
    """A spare's warm-up reads slot 0's batch (``catching_up.lent_slot``), consuming nothing."""
    optimizer_step: bool = False
    """A joiner's warm-up steps the optimizer (its state is overwritten by the snapshot); a standby's does not."""
    t_backward: float = 0.0
    t_forward: tuple[float, float] = (0.0, 0.0)
    """The last forward's start and end (the root module's hooks; the timeline's compute spans)."""
    t_computed: float = 0.0
    slowed: float = 0.0
    settled: tuple[Commit, list[ExchangeResult]] | None = None
    """The step's exchange, voted and committed to, its averaged gradients bound as ``.grad`` (end of backward)."""
    error: BaseException | None = None
    """What the end of backward raised (raised again by ``finish``)."""
    losses: list[float] = field(default_factory=list)
    dealt: tuple[int, ...] = ()
    """The slot mask positions it trains (``carry``): its slot's micro-batches, and those of orphans it carries."""
    taken: int = 0
    """How many of them the trainer took (``take``)."""


class Steps(StepCore):
    """The replica's step drivers, on its step core (a base of ``Replica``)."""

    def __init__(self, config: RuntimeConfig, layout: str = "") -> None:
        super().__init__(config, layout)
        self.role: roles.Role = roles.Standby()
        """What this replica does at the start of its next step (``fthsdp.runtime.roles``)."""
        self._iter: Iteration | None = None
        self.iteration = 0
        """How many iterations of the trainer's loop began (``begin``): a data loader's clock."""
        self._total: int | None = None  # the job's steps, from ``steps``
        self.on_steps_end: Callable[[], None] | None = None
        """Run when the loop over ``steps`` ends (``fthsdp.runtime.init``: the job's end and ``close``)."""
        self._results: deque[StepResult] = deque(maxlen=RESULTS_KEPT)
        self.on_result: Callable[[StepResult], None] | None = None
        """Called with every step's result as it commits (those committed inside ``zero_grad`` or ``train_step``
        without a batch too: a spare's, which may stay there for many steps, and a joiner's): a trainer's progress
        log."""
        self.on_committed: Callable[[StepResult], None] | None = None
        """The same, for the runtime's own use (``fthsdp.runtime.session``: a launcher's step rows), left to it
        whatever the trainer sets as ``on_result``."""

    def attach(self, model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer,
               buckets: BucketExchange) -> None:
        super().attach(model, params, opt, buckets)
        model.register_forward_pre_hook(self._forward_begins)  # the timeline's forward and backward spans
        model.register_forward_hook(self._forward_ends)

    def _forward_begins(self, *_: object) -> None:
        """A forward of the step's model begins: the micro-batch before's backward (accumulation) ended."""
        if (it := self._iter) is not None and it.trains and not it.settled:
            now = self.timeline.tick()
            if it.t_forward[1]:
                self.timeline.span("backward", "compute", it.step, it.t_forward[1], now, micro_batch=True)
            it.t_forward = (now, 0.0)

    def _forward_ends(self, *_: object) -> None:
        if (it := self._iter) is not None and it.trains and it.t_forward[0] and not it.t_forward[1]:
            it.t_forward = (it.t_forward[0], self.timeline.tick())
            self.timeline.span("forward", "compute", it.step, *it.t_forward)

    def pace(self, attempts: int, step: int, compute_s: float, wait_s: float) -> None:
        """Fail-slow evidence: a step's compute and wait to Prometheus; a failure-free one's to the lighthouse too,
        with every rank's busy time and lane time from the step's vote (``ranks_busy_ms``: which rank the slowness
        comes from; ``ranks_lane_ms``: which lane is slow)."""
        self.metrics.on_pace(compute_s, wait_s)
        if attempts == 1 and (pace := self.pace_window.add(step, compute_s, wait_s, self.ranks_busy_ms,
                                                           self.ranks_lane_ms)) is not None and self.rank == 0:
            self.client.set_pace(pace)

    def become(self, role: roles.Role) -> None:
        """Take ``role`` (a role's turn names the next one). A standby leaving its role was registered: the step core
        takes its place then (``StepCore.registered``)."""
        if type(role) is not type(self.role):
            self.timeline.mark(f"role {type(role).__name__.lower()}", self.step)
        was, self.role, self.standing = self.standing, role, role.standing
        self.metrics.on_joining(self.joining)
        if was is Standing.STANDBY and role.standing is not Standing.STANDBY:
            self.registered()

    def turn(self, closure: Callable[[], torch.Tensor] | None) -> StepResult | None:
        """The role's step (one that trains no batch); the next role taken."""
        turn = self.role.turn(self, closure)
        self.become(turn.next)
        return turn.result

    # --- the trainer's own loop (``fthsdp.runtime.loop``) ------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """``for step in ft.steps(total):`` the index of the step the next iteration trains, until ``total`` steps
        are committed (a failure costs iterations that commit nothing: a loop over ``range(total)`` would end
        short)."""
        if total < 0:
            raise ValueError(f"total steps must be >= 0, got {total}")
        self._total = total
        while self.step < total:
            yield self.step
        if self.on_steps_end is not None:
            self.on_steps_end()

    def begin(self) -> bool:
        """``zero_grad()`` of the optimizer ``optimizer`` returned: begin the next iteration of the trainer's loop.

        First runs what this replica's role needs that trains no batch, each a committed step of its own (see
        ``pop_results``): a warm standby's release and registration, a joiner's catch-up (zeros exchanged while it
        fetches, then load and replay) and the zero step after it, a spare's zero steps until it is handed a slot.
        Returns True when this iteration trains a batch of the replica's slot: its gradient shards are exchanged
        during ``backward()`` as FSDP2 produces them, and ``backward()`` returns with the step's averaged
        gradients as ``.grad``. False for an iteration that exchanges nothing: a warm-up (a process's slow first
        step, before it is a member; its batch is not consumed) or one past the job's last step."""
        shards, buckets = self.parts()
        # The trainer's own loop: it may change .grad (never the bytes FTAR keeps), and every step ends with a post
        # exchange (``BucketExchange.posts``, which the step core reads too).
        buckets.alias, buckets.posts = False, True
        if (it := self._iter) is not None:
            if it.settled is not None or it.t_backward:
                raise RuntimeError(f"zero_grad() at step {it.step} after its backward: call optimizer.step() after "
                                   "the last backward of every iteration (the others commit that step)")
            shards.opt.zero_grad(set_to_none=True)
            return it.trains
        self.iteration += 1
        dealt: tuple[int, ...] = ()
        while not dealt:
            while not self.role.trains:  # a standby's release, a catch-up, a zero step, a spare's steps (committed)
                if self._total is not None and self.step >= self._total:
                    return self._idle(optimizer_step=False)
                if (optimizer_step := self.role.loop_warm_up(self)) is not None:
                    return self._idle(optimizer_step)
                if (result := self.turn(None)) is not None:
                    self.deliver(result)
            if self._total is not None and self.step >= self._total:
                return self._idle(optimizer_step=False)
            if buckets.posted != self.step - 1:  # a lane's sequence begins with the post of the step before: the
                self.post(self.step - 1, *buckets.post_again(self.step - 1))  # job's first, a resume, a redo
            if not (dealt := self._deal()):  # carrying, and no epoch deals it anything yet: zeros, committed
                with carry.redealt(self):
                    self.deliver(catching_up.zero_step(self, self.exchange_all(contribute=False),
                                                       redo=functools.partial(carry.redo, self, ())))
        self.faults.hold(self.step, self.feed, self.log)  # FTHSDP_FAULT_HOLD_UNTIL
        buckets.digest = self.check.digest(self.step, shards, self.cursors, self.world_size, self.device)
        self.faults.at(self.step, Phase.FORWARD)
        shards.opt.zero_grad(set_to_none=True)
        self._iter = Iteration(self.step, trains=True, slot=self.slot, t0=time.perf_counter(), cpu0=time.process_time(),
                               dealt=dealt)
        buckets.arm(self.step, at_first=self._backward_begins, at_end=self._backward_ends)
        return True

    def _deal(self) -> tuple[int, ...]:
        """The slot mask positions this iteration trains: its slot's micro-batches; with orphan slots carried, what
        rank 0's newest epoch deals the replica (``carry``), once the step before's post exchange is done (the lane
        leaves an older data plane's group for the deal's, sending that post exchange again there)."""
        _, buckets = self.parts()
        if not self.carrying:
            return carry.own(self.slot, self.config.micro_batches)
        posts.agree(buckets, self.wait_s)
        epoch, plane, dealt = carry.agree_deal(self)
        if carry.leave_older_plane(self, epoch, plane):  # not waited for: the step's vote sees it fail
            buckets.launch_post(self.step - 1, *buckets.post_again(self.step - 1))
        buckets.dealt, buckets.fits = dealt, carry.pinned(self, dealt)
        return dealt

    def _idle(self, optimizer_step: bool) -> bool:
        """An iteration that exchanges nothing (``begin``): a warm-up, or one past the last step."""
        self.parts()[0].opt.zero_grad(set_to_none=True)
        lent = self.slot == m.NO_SLOT  # a spare's loop reads slot 0's batch, consuming nothing
        if lent:
            self.slot = 0
        self._iter = Iteration(self.step, trains=False, t0=time.perf_counter(), lent=lent,
                               optimizer_step=optimizer_step, dealt=carry.own(self.slot, self.config.micro_batches))
        return False

    def _backward_begins(self) -> None:
        """The step's first gradient shard is out of FSDP2 (the FSDP2 hook): fault hooks, and the compute clock."""
        it = self._iter
        assert it is not None
        it.slowed = self.faults.slow_down(it.step, self.own_compute_s)  # FTHSDP_FAULT_SLOW
        self.faults.at(it.step, Phase.BACKWARD)
        it.t_backward = time.perf_counter()

    def _backward_ends(self) -> None:
        """The backward pass ended (an autograd final callback, still inside ``backward()``): launch the buckets
        that got no gradient, settle the exchange (redoing it under a new epoch if a peer died), vote with the
        replica's other ranks and bind the averaged gradients as ``.grad``, a copy the trainer may change. What
        goes wrong is raised by ``finish``, outside autograd."""
        it = self._iter
        if it is None or it.settled is not None or it.error is not None:
            return
        _, buckets = self.parts()
        try:
            handles = buckets.launch_rest(it.step)
            buckets.disarm()
            it.t_computed = self.timeline.tick()
            self.busy_ms = round((time.process_time() - it.cpu0) * 1e3)
            it.t_backward = it.t_backward or it.t_computed
            self.timeline.span("backward", "compute", it.step, it.t_forward[1] or it.t0, it.t_computed)
            if self.carrying and it.taken != len(it.dealt):
                raise RuntimeError(f"step {it.step}: {it.taken} of the {len(it.dealt)} micro-batches dealt to this "
                                   "replica were taken: with FTHSDP_ORPHANS=carry iterate the step's batches (`for "
                                   "batch in loader:` over ft.dataloader(...), or `for slot, cursor, micro in "
                                   "ft.dealt():`)")
            it.settled = self.settle(handles, contribute=True,
                                     redo=functools.partial(carry.redo, self, it.dealt) if self.carrying else None)
            posts.agree(buckets, self.wait_s)  # the step before's post exchange came back before this step's buckets
            self.timeline.span("wait", "wait", it.step, it.t_computed, time.perf_counter(),
                               attempts=it.settled[0].attempts)
            buckets.install(it.settled[1])
        except BaseException as e:  # noqa: BLE001 - handed to finish(), which raises it outside autograd
            it.error = e

    def dealt(self) -> Iterator[tuple[int, int, int]]:
        """``for slot, cursor, micro in ft.dealt():`` the micro-batches this iteration trains, as (data slot, its
        cursor, micro-batch): the replica's own slot's ``FTHSDP_MICRO_BATCHES`` and, with orphan slots carried, its
        share of theirs. FSDP2's gradient sync is on for the last one only (``take``)."""
        if (it := self._iter) is None:
            raise RuntimeError("ft.dealt() before optimizer.zero_grad(): zero_grad() begins a step")
        for k in range(len(it.dealt)):
            yield self.take(k)

    @property
    def carrying(self) -> bool:
        """Orphan slots are carried (``FTHSDP_ORPHANS=carry``): an iteration trains what its deal names."""
        return self.config.carry_orphans

    def step_batches(self) -> tuple[tuple[int, int, int], ...]:
        """This iteration's micro-batches as (data slot, its cursor, micro-batch) (``dealt``)."""
        if (it := self._iter) is None:
            raise RuntimeError("no iteration: optimizer.zero_grad() begins a step")
        parts = self.config.micro_batches
        return tuple((slot, int(self.cursors[slot]), micro) for slot, micro in (divmod(p, parts) for p in it.dealt))

    def take(self, k: int) -> tuple[int, int, int]:
        """The trainer takes micro-batch ``k`` of this iteration (``step_batches``): FSDP2's gradient sync on for the
        last only (each FSDP2 unit), so the exchange runs once; on each with the exact sum (FTHSDP_DETERMINISTIC)."""
        it = self._iter
        assert it is not None
        batches = self.step_batches()
        last = k == len(batches) - 1
        self.parts()[1].last_micro = last
        for unit in self.model.modules() if self.model is not None else ():
            if isinstance(unit, FSDPModule):
                unit.set_requires_gradient_sync(last or self.config.deterministic, recurse=False)
        it.taken = max(it.taken, k + 1)
        return batches[k]

    def note_loss(self, loss: torch.Tensor | float) -> None:
        """Add ``loss`` (a micro-batch's, as scaled for accumulation) to this rank's loss of the step: ``step()``'s
        result carries it averaged over the step's contributing replicas (``StepResult.loss``). That costs a wait at
        ``step()`` for the step's post exchange, which otherwise runs off the step's path."""
        if self._iter is not None and self._iter.trains:
            self._iter.losses.append(float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss))

    def finish(self) -> StepResult | None:
        """``step()`` of the optimizer ``optimizer`` returned: end the iteration. For one that trained a batch:
        find the factor the trainer scaled the averaged gradients by (``grad_scale``; clipping), tell the others
        in the step's post exchange (a joiner or a spare applies it too), run the optimizer step with the
        degraded-mode learning rate, step the scheduler, advance the data cursors. Returns the committed step's
        result (also in ``pop_results``); None for an iteration that trained nothing (a warm-up)."""
        it = self._iter
        if it is None:
            raise RuntimeError("optimizer.step() without optimizer.zero_grad() first: zero_grad() begins a step")
        shards, buckets = self.parts()
        try:
            if not it.trains:
                if it.optimizer_step:
                    shards.opt.step()
                shards.opt.zero_grad(set_to_none=True)
                if self.joining or self.standby or it.lent:
                    self.joiner.warmed, self.joiner.probe_s = True, time.perf_counter() - it.t0
                    self.log(logging.INFO, "warm-up iteration took %.3fs", self.joiner.probe_s)
                return None
            if it.settled is None and it.error is None:
                self._backward_ends()  # no gradient reached FSDP2's hooks in this iteration
            if isinstance(it.error, carry.Redeal):  # nothing committed: the loop trains the step again
                self.log(logging.WARNING, "%s", it.error)
                buckets.posted = None  # the step's exchange begins again with the step before's post exchange
                return None
            if it.error is not None:
                raise it.error
            assert it.settled is not None
            commit, results = it.settled
            factor = grad_scale.scale_of(buckets.averaged(results), buckets.grads())
            if not it.losses:  # nobody waits for the post exchange here: the next step's settle reads it
                buckets.launch_post(commit.step, factor, None)
                return self._committed(it, commit, results, None)
            agreed, mean_loss = self.post(commit.step, factor, sum(it.losses))  # the mean loss: wait for it
            grad_scale.check_agreed(commit.step, factor, agreed)
            return self._committed(it, commit, results, mean_loss)
        finally:
            if it.lent:
                self.slot = m.NO_SLOT
            self._iter = None
            buckets.disarm()

    def _committed(self, it: Iteration, commit: Commit, results: list[ExchangeResult],
                   loss: float | None) -> StepResult:
        """The commit of a step the trainer's loop trained: the optimizer step (its gradients are bound already),
        then what every commit does."""
        t_end = time.perf_counter()
        exchange_s = t_end - it.t_backward
        self.own_compute_s = it.t_computed - it.t0 - it.slowed
        self.pace(commit.attempts, commit.step, it.t_computed - it.t0, t_end - it.t_computed)
        batches = self.commit(commit.step, results, installed=True)
        diverged = self.check.check(commit.step, results)
        contributors = results[0].contributors
        carried = tuple(sorted({p // self.config.micro_batches for p in it.dealt} - {it.slot}))
        result = StepResult(commit.step, loss, commit.epoch, contributors, False, commit.attempts, exchange_s, batches,
                            self.lr_factor, diverged=diverged, lr=self.applied_lr, slot=it.slot, carried=carried)
        self.publish(result, commit, results, exchange_s)
        if self.rank == 0 and self.config.step_log:
            self.log(logging.INFO, "step %d committed: loss %s, %d contributor(s), %d attempt(s), lr %s, exchange "
                      "%.3fs", commit.step, "-" if loss is None else f"{loss:.4f}", contributors, commit.attempts,
                      [f"{x:.3g}" for x in self.applied_lr], exchange_s)
        return result

    def publish(self, result: StepResult, commit: Commit, results: list[ExchangeResult], exchange_s: float) -> None:
        """After a trained step's optimizer step: its metrics, its result handed out (``deliver``), the commit
        boundary's duties (``after_commit``)."""
        self.metrics.on_exchange(sum(t.numel() * t.element_size() for r in results for t in r.tensors), exchange_s)
        self.metrics.on_commit(commit.step, commit.epoch, result.contributors, commit.attempts,
                               stall_s=exchange_s if commit.attempts > 1 else 0.0)
        self.deliver(result)
        self.after_commit(self.held, commit.stop)

    @property
    def applied_lr(self) -> list[float]:
        """The learning rate of each param group as the last optimizer step applied it: the scheduler's value times
        the degraded-mode factor (``lr_factor``: fewer replicas contributed)."""
        return [float(g["lr"]) * self.lr_factor for g in self.parts()[0].opt.param_groups]

    def deliver(self, result: StepResult) -> None:
        """A step committed: keep its result for ``pop_results`` and hand it to ``on_committed`` and ``on_result``."""
        self._results.append(result)
        for hook in (self.on_committed, self.on_result):
            if hook is not None:
                hook(result)

    def pop_results(self) -> list[StepResult]:
        """Every step committed since the last call, oldest first: the trained ones (also returned by ``step()``)
        and those ``begin`` committed without a batch (a catch-up, a zero step, a spare's steps)."""
        out = list(self._results)
        self._results.clear()
        return out

    def dataloader(self, dataset: Dataset[Any], batch_size: int, *, micro_batches: int = 1, seed: int = 0,
                   shuffle: bool = True, mesh: DeviceMesh | None = None, **loader_kwargs: Any) -> SlotLoader:
        """A ``torch.utils.data.DataLoader`` over ``dataset`` (map-style) that yields this rank's next batches of
        the replica's data slot, ``micro_batches`` per step, by the slot's cursor: every batch is trained exactly
        once across failures, and the position follows a catch-up or a resume (``loop.SlotLoader``). ``mesh``: the
        1-D mesh of the replica's ranks that split the slot's batch (its data-parallel dimension, e.g.
        ``mesh["dp"]`` of a tensor-parallel replica, whose TP ranks then read the same batch); by default every
        rank of the replica. Other keyword arguments go to the ``DataLoader`` (``num_workers``, ``collate_fn``,
        ``pin_memory``, ...)."""
        if self.carrying and micro_batches != self.config.micro_batches:
            raise ValueError(f"micro_batches={micro_batches}: with orphan slots carried every replica deals "
                             f"FTHSDP_MICRO_BATCHES={self.config.micro_batches} per slot and step")
        return SlotLoader(self, dataset, batch_size, micro_batches=micro_batches, seed=seed, shuffle=shuffle,
                          split=data_split(mesh, self.world_size), **loader_kwargs)
