"""``train_step(closure)``: the runtime runs a step's forward and backward itself (the closure returns the loss), one
committed step per call, on the same step core and roles as the trainer's own loop (``fthsdp.runtime.iteration``,
the way documented first)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from fthsdp.runtime.config import ConfigError, RuntimeConfig
from fthsdp.runtime.faults import Phase
from fthsdp.runtime.iteration import Steps
from fthsdp.runtime.result import StepResult


class ClosureSteps(Steps):
    """The replica's steps with ``train_step`` (a base of ``Replica``)."""

    def __init__(self, config: RuntimeConfig, layout: str = "") -> None:
        super().__init__(config, layout)
        self._queued: deque[StepResult] = deque()
        """With orphan slots carried: steps committed inside ``begin`` (a catch-up, zero steps) not yet returned."""

    def train_step(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """Run one step: ``closure()`` returns the loss (the runtime calls ``backward``). Returns once the step is
        committed. A joining replica calls ``closure`` once to warm up (the result is thrown away: see
        ``fthsdp.runtime.join.warm_up``), then catches up (it exchanges zeros while fetching the state) and
        returns once it holds the same state as the others, with ``joined=True``. With orphan slots carried
        (``FTHSDP_ORPHANS=carry``) the step is the trainer's-loop one (``_carrying_step``)."""
        if self.config.carry_orphans:
            return self._carrying_step(closure)
        shards, buckets = self.parts()
        while not self.role.trains:  # a standby's release, a catch-up, a zero step, a spare's step
            if (result := self.turn(closure)) is not None:
                self.deliver(result)
                return result
        slot = self.slot
        self.faults.hold(self.step, self.feed, self.log)  # FTHSDP_FAULT_HOLD_UNTIL
        buckets.digest = self.check.digest(self.step, shards, self.cursors, self.world_size, self.device)
        self.faults.at(self.step, Phase.FORWARD)
        shards.opt.zero_grad(set_to_none=True)
        t_compute, cpu0 = self.timeline.tick(), time.process_time()
        with buckets.armed(self.step):  # buckets go to FTAR as FSDP2 produces their gradient shards
            loss = closure()
            slowed = self.faults.slow_down(self.step, self.own_compute_s)  # FTHSDP_FAULT_SLOW
            self.faults.at(self.step, Phase.BACKWARD)
            t0 = self.timeline.tick()
            loss.backward()  # type: ignore[no-untyped-call]
        loss_value = float(loss.detach().item())
        handles = buckets.launch_rest(self.step)  # parameters that got no gradient
        t_computed = self.timeline.tick()
        self.busy_ms = round((time.process_time() - cpu0) * 1e3)
        commit, results = self.settle(handles, contribute=True)
        exchange_s = time.perf_counter() - t0
        self.timeline.span("forward", "compute", commit.step, t_compute, t0)
        self.timeline.span("backward", "compute", commit.step, t0, t_computed)
        self.timeline.span("wait", "wait", commit.step, t_computed, t0 + exchange_s, attempts=commit.attempts)
        self.own_compute_s = t_computed - t_compute - slowed
        self.pace(commit.attempts, commit.step, t_computed - t_compute, time.perf_counter() - t_computed)
        batches = self.commit(commit.step, results)
        diverged = self.check.check(commit.step, results)
        contributors = results[0].contributors
        result = StepResult(commit.step, loss_value, commit.epoch, contributors, False, commit.attempts,
                            exchange_s, batches, self.lr_factor, diverged=diverged, slot=slot)
        self.publish(result, commit, results, exchange_s)
        if self.rank == 0 and self.config.step_log:
            self.log(logging.INFO, "step %d committed: loss %.4f, %d contributor(s), %d attempt(s), exchange "
                      "%.3fs", commit.step, loss_value, contributors, commit.attempts, exchange_s)
        return result

    def _carrying_step(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """``train_step`` with orphan slots carried: the trainer's-loop iteration (``begin``, a forward and backward
        per batch dealt, ``finish``), the closure called once per dealt slot with ``ft.slot`` and ``ft.cursor``
        reading that slot's batch (``next_batch`` does), a warm-up iteration's included; a redealt step is trained
        again. One committed step per call, as without carrying: those committed inside ``begin`` (a catch-up, a
        zero step) first, in order. The result's loss: this rank's mean over the batches it trained."""
        if self.config.micro_batches != 1:
            raise ConfigError(f"FTHSDP_MICRO_BATCHES={self.config.micro_batches} with train_step(closure) and "
                              "FTHSDP_ORPHANS=carry: the closure computes a whole slot's batch; accumulate "
                              "micro-batches in the trainer's own loop (zero_grad, backward per micro-batch, step)")
        while True:
            if self._queued:
                return self._queued.popleft()
            if self._iter is None:
                last = self._results[-1] if self._results else None
                self.begin()
                self._queued.extend(_after(self._results, last))  # committed inside begin: returned first
                continue
            losses = []
            for slot, _cursor, _micro in self.dealt():
                with self._reading(slot):
                    loss = closure()
                loss.backward()  # type: ignore[no-untyped-call]
                losses.append(loss.detach())
            result = self.finish()  # None: a warm-up, or a step dealt anew (trained again)
            if result is not None:
                return dataclasses.replace(result, loss=float(torch.stack(losses).mean()))

    @contextlib.contextmanager
    def _reading(self, slot: int) -> Iterator[None]:
        """While the closure computes a batch dealt to this replica: ``slot`` is the one ``ft.slot`` names."""
        own, self.slot = self.slot, slot
        try:
            yield
        finally:
            self.slot = own


def _after(results: deque[StepResult], last: StepResult | None) -> list[StepResult]:
    """The results appended to ``results`` after ``last`` (all of them when ``last`` is None), oldest first."""
    out: list[StepResult] = []
    for r in reversed(results):
        if r is last:
            break
        out.append(r)
    return out[::-1]
