"""A warm standby (``FTHSDP_STANDBY_GATE``; docs/design.md §7, "Warm restarts"): a replica process a launcher
starts ahead of need. It runs the trainer's own set-up unregistered (``Replica()``, ``shard``, ``optimizer``: no
lighthouse call), and at its first ``train_step`` warms up and waits for its gate file. Once the launcher creates
the file (to replace a failed incarnation of the group) it registers and goes on, in that same call, as the role
the lighthouse gives it: a joiner catches up, an active replica resumes from the newest checkpoint, a replica back
after the job finished raises ``JobFinished``. So a restart costs the registration and the catch-up only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from fthsdp.runtime.catching_up import lent_slot
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.join import Joiner, warm_up
from fthsdp.runtime.startup import hold_as_standby


class Replica(Protocol):
    """What a standby's release uses of ``fthsdp.runtime.replica.Replica`` (which imports this module)."""

    config: RuntimeConfig
    joiner: Joiner
    slot: int
    standby: bool
    opt: torch.optim.Optimizer | None
    _registered: list[Callable[[], object]]

    def _register(self) -> None: ...
    def _take_role(self) -> None: ...
    def _log(self, level: int, msg: str, *args: object) -> None: ...


def take_place(ft: Replica, closure: Callable[[], torch.Tensor]) -> None:
    """A standby's first ``train_step``, up to where any replica's first step starts: warm up (with
    ``FTHSDP_JOIN_WARMUP``), then ``release``."""
    assert ft.opt is not None
    if ft.config.join_warmup:
        # No optimizer step: the role is not known yet (an active replica with no checkpoint trains from the state
        # as built); a joiner's optimizer state comes with its snapshot. A spare group's standby has no slot to
        # read a batch from: it borrows slot 0's, consuming nothing.
        with lent_slot(ft):
            warm_up(ft.opt, closure, ft._log, optimizer_step=False)
        ft.joiner.warmed = True
    release(ft)


def release(ft: Replica) -> None:
    """Wait for the gate, register, take the role (``Replica._take_role``), then run what waited for the
    registration (``Replica.when_registered``). The trainer's own loop warms up before, in an iteration of its own
    (``Replica.begin``)."""
    ft._log(logging.INFO, "warm standby: waiting for %s", ft.config.standby_gate)
    held = hold_as_standby(ft.config.standby_gate)
    ft.standby = False
    ft._log(logging.INFO, "released after %.1fs as a warm standby; registering", held)
    ft._register()
    ft._take_role()
    for fn in ft._registered:
        fn()
    ft._registered.clear()
