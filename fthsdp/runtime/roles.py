"""What a replica does at the start of a step: its role (docs/design.md §3a, "Roles").

Every role takes a step on the step core (``fthsdp.runtime.core``) and names the role of the next one
(``StepCore.become``). Only ``Active`` trains a batch of the replica's data slot: the trainer's loop (or
``train_step``) computes it. The others' steps commit like everyone's but train no batch, and consume no data:

- ``Standby``: a warm standby, not registered yet; released, it registers and becomes what the lighthouse says;
- ``Joining``: catches up with the others (zeros exchanged while it fetches, then load and replay), then ``CaughtUp``;
- ``CaughtUp``: the one zero step after the catch-up (its zeros are in flight already), then ``Active`` or ``Spare``;
- ``Spare``: no data slot; it exchanges zeros and commits as the others do until the lighthouse hands it a slot;
- ``Finished``: the job ended before this replica came back, or while it asked to join; it trains nothing
  (``JobFinished``).

In the trainer's own loop, a role that needs a warm-up first (a process's slow first forward and backward, before
the others wait for it) asks for one iteration that exchanges nothing (``loop_warm_up``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ftar import Handle
from fthsdp.runtime import catching_up, spares, standby, startup
from fthsdp.runtime.core import StepCore
from fthsdp.runtime.errors import FinishedWhileJoining, JobFinished
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.standing import Standing
from fthsdp.runtime.startup import Role as Given
from lighthouse.model import NO_SLOT

Closure = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Turn:
    """A role's step: what it committed (None: nothing, the role changed first) and the role of the next step."""

    result: StepResult | None
    next: Role


class Role(abc.ABC):
    """A replica's role for its next step."""

    standing: ClassVar[Standing]
    """What the replica's state is in this role (all the step core knows of it)."""
    trains: ClassVar[bool] = False
    """Its step trains a batch of the replica's slot, which the trainer computes (``Active``)."""

    def loop_warm_up(self, core: StepCore) -> bool | None:
        """In the trainer's own loop: None, or an iteration that warms up and exchanges nothing first (True: with an
        optimizer step, which the catch-up's snapshot overwrites)."""
        return None

    @abc.abstractmethod
    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        """This role's step, one that trains no batch. ``closure``: ``train_step``'s (a warm-up may call it); None
        in the trainer's own loop."""


class Active(Role):
    """Trains its slot's batch every step (the trainer computes it; ``fthsdp.runtime.iteration``)."""

    standing = Standing.MEMBER
    trains = True

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        raise AssertionError("an active replica's step trains a batch: the driver runs it")


class Standby(Role):
    """A warm standby (``fthsdp.runtime.standby``): warm up, wait for the gate, register, take the role given."""

    standing = Standing.STANDBY

    def loop_warm_up(self, core: StepCore) -> bool | None:
        return False if core.config.join_warmup and not core.joiner.warmed else None

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        if closure is not None:
            spares.warm(core, closure)  # the trainer's loop warms up in an iteration of its own
        return Turn(None, given(standby.release(core), core.slot))


class Finished(Role):
    """Back after the job finished: it holds the final checkpoint and trains nothing."""

    standing = Standing.FINISHED

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        raise JobFinished(f"job {core.config.job_id!r} finished at step {core.step}: nothing left to train", core.step)


class Joining(Role):
    """Catches up with the others without stalling them (``fthsdp.runtime.catching_up``)."""

    standing = Standing.JOINING

    def loop_warm_up(self, core: StepCore) -> bool | None:
        warm = core.config.join_warmup and not core.joiner.warmed and not core.joiner.announced
        return True if warm else None

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        try:
            result, zeros = catching_up.catch_up(core, closure)
        except FinishedWhileJoining as e:
            return Turn(None, finished_meanwhile(core, e.step))
        return Turn(result, CaughtUp(zeros))


class CaughtUp(Role):
    """Caught up: its next step's zeros are in flight already (sent before the replay's last slice)."""

    standing = Standing.MEMBER

    def __init__(self, zeros: list[Handle | None]) -> None:
        self.zeros = zeros

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        result = catching_up.zero_step(core, self.zeros)
        if core.config.carry_orphans:
            # Active only now: an epoch listing it active deals it its slot, which the others then stop carrying,
            # and this zero step trains none (told before it, the lighthouse made a step train no batch of that slot).
            core.joiner.turn_active()
        return Turn(result, Active() if core.slot != NO_SLOT else Spare())


class Spare(Role):
    """No data slot: shadows the others' steps (``fthsdp.runtime.spares``) until the lighthouse hands it one."""

    standing = Standing.MEMBER

    def __init__(self, warm_up: bool = True) -> None:
        self.shadow = spares.Shadow()
        """Its step clock: is a slot handed over early enough in a step to train it in that step?"""
        self.warm_up = warm_up
        """Warm up before its first step (with ``FTHSDP_JOIN_WARMUP``). Not a spare the job starts (or resumes)
        with: it is a member of the first epoch, and every member waits for its first exchange, which a warm-up
        iteration would only delay (the others' first step is a cold one too)."""

    def loop_warm_up(self, core: StepCore) -> bool | None:
        return False if self.warm_up and core.config.join_warmup and not core.joiner.warmed else None

    def turn(self, core: StepCore, closure: Closure | None) -> Turn:
        result = spares.spare_step(core, closure, self.shadow, warm_first=self.warm_up)
        return Turn(result, Active() if core.slot != NO_SLOT else self)


def finished_meanwhile(core: StepCore, step: int, when: str = "while this replica was joining") -> Role:
    """The job finished at ``step`` while this replica asked to enter the data plane (or before its step committed:
    ``when``): as a registration answered finished, it takes the final checkpoint (``JobFinished`` if there is
    none) and trains nothing; the trainer's loop then ends as the others' did, with no restart to learn that."""
    cfg = core.config
    core.resume = startup.start_from(Given.FINISHED, step, cfg.job_id, cfg.checkpoint_dir)
    core.client.close()  # its incarnation is over: nothing to heartbeat
    core.standing = Standing.FINISHED
    core.take_place()
    core.log(logging.WARNING, "the job finished at step %d %s: took its final checkpoint, training nothing", step,
             when)
    return Finished()


def given(role: Given, slot: int) -> Role:
    """The role of a replica the lighthouse just registered as ``role``, asking for ``slot``."""
    if role == Given.FINISHED:
        return Finished()
    if role == Given.JOINING:
        return Joining()
    return Active() if slot != NO_SLOT else Spare(warm_up=False)  # in the first epoch: no time to warm up
