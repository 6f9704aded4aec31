"""``train_step(closure)``: the runtime runs a step's forward and backward itself (the closure returns the loss), one
committed step per call, on the same step core and roles as the trainer's own loop (``fthsdp.runtime.iteration``,
the way documented first)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fthsdp.runtime.config import ConfigError
from fthsdp.runtime.faults import Phase
from fthsdp.runtime.iteration import Steps
from fthsdp.runtime.result import StepResult


class ClosureSteps(Steps):
    """The replica's steps with ``train_step`` (a base of ``Replica``)."""

    def train_step(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """Run one step: ``closure()`` returns the loss (the runtime calls ``backward``). Returns once the step is
        committed. A joining replica calls ``closure`` once to warm up (the result is thrown away: see
        ``fthsdp.runtime.join.warm_up``), then catches up (it exchanges zeros while fetching the state) and
        returns once it holds the same state as the others, with ``joined=True``."""
        if self.config.carry_orphans:
            raise ConfigError("FTHSDP_ORPHANS=carry needs the trainer's own loop (zero_grad, backward, step) iterating "
                              "the step's batches: train_step(closure) trains one batch per step")
        shards, buckets = self.parts()
        while not self.role.trains:  # a standby's release, a catch-up, a zero step, a spare's step
            if (result := self.turn(closure)) is not None:
                self.deliver(result)
                return result
        slot = self.slot
        buckets.digest = self.check.digest(self.step, shards, self.cursors, self.world_size, self.device)
        self.faults.at(self.step, Phase.FORWARD)
        shards.opt.zero_grad(set_to_none=True)
        t_compute, cpu0 = time.perf_counter(), time.process_time()
        with buckets.armed(self.step):  # buckets go to FTAR as FSDP2 produces their gradient shards
            loss = closure()
            slowed = self.faults.slow_down(self.step, self.own_compute_s)  # FTHSDP_FAULT_SLOW
            self.faults.at(self.step, Phase.BACKWARD)
            t0 = time.perf_counter()
            loss.backward()  # type: ignore[no-untyped-call]
        loss_value = float(loss.detach().item())
        handles = buckets.launch_rest(self.step)  # parameters that got no gradient
        t_computed = time.perf_counter()
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
