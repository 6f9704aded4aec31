"""Failure injection for tests and demos: ``FTHSDP_FAULT=STEP:PHASE`` makes rank 0 SIGKILL its whole replica
group (the torchrun agent, hence every worker) when it reaches PHASE of STEP or of the first step after it (a
replica that joins late starts past STEP). Phases: forward, backward, exchange, vote, optimizer; ``serve``
(while this replica streams a catch-up snapshot to a joiner, STEP being the snapshot's step) and ``fetch`` (while
this joining replica fetches one)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

PHASES = ("forward", "backward", "exchange", "vote", "optimizer", "serve", "fetch")


@dataclass(frozen=True)
class FaultInjector:
    step: int = -1
    phase: str = ""
    armed: bool = False

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector":
        spec = os.environ.get("FTHSDP_FAULT", "")
        if not spec or rank != 0:
            return cls()
        step, _, phase = spec.partition(":")
        phase = phase or "forward"
        if phase not in PHASES:
            raise ValueError(f"FTHSDP_FAULT phase {phase!r} is not one of {PHASES}")
        return cls(int(step), phase, True)

    def at(self, step: int, phase: str) -> None:
        if self.armed and step >= self.step and phase == self.phase:
            if "TORCHELASTIC_RUN_ID" in os.environ:
                os.kill(os.getppid(), signal.SIGKILL)  # the agent; workers follow (PDEATHSIG)
            os.kill(os.getpid(), signal.SIGKILL)
