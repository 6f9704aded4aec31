"""Failure injection for tests and demos: ``FTHSDP_FAULT=STEP:PHASE`` makes rank 0 SIGKILL its whole replica
group (the torchrun agent, hence every worker) when it reaches PHASE of STEP or of the first step after it (a
replica that joins late starts past STEP). Phases: forward, backward, exchange, vote, optimizer; ``serve``
(while this replica streams a catch-up snapshot to a joiner, STEP being the snapshot's step) and ``fetch`` (while
this joining replica fetches one).

``FTHSDP_FAULT_FILE=PATH`` (the chaos runner's switch) arms a fault while the replica runs: rank 0 reads
``STEP:PHASE`` from PATH whenever the file changes (one ``stat`` per phase) and fires as above; an absent or empty
file disarms it."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

PHASES = ("forward", "backward", "exchange", "vote", "optimizer", "serve", "fetch")


@dataclass(frozen=True)
class FaultInjector:
    step: int = -1
    phase: str = ""
    armed: bool = False
    path: str = ""
    """``FTHSDP_FAULT_FILE``: a fault armed from outside while running."""
    _file: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What ``path`` held when last read: its inode, mtime and size, and the fault parsed from it (or None)."""

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        spec = os.environ.get("FTHSDP_FAULT", "")
        path = os.environ.get("FTHSDP_FAULT_FILE", "") if rank == 0 else ""
        if not spec or rank != 0:
            return cls(path=path)
        step, phase = _parse(spec)
        return cls(step, phase, True, path=path)

    def _from_file(self) -> tuple[int, str] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._file.clear()
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # the runner replaces it atomically: a new inode
        if self._file.get("key") != key:
            try:
                with open(self.path) as f:
                    spec = f.read().strip()
            except OSError:
                return None
            try:
                fault = _parse(spec) if spec else None
            except ValueError:  # written by the runner atomically; a bad one arms nothing
                fault = None
            self._file.update(key=key, fault=fault)
        return self._file.get("fault")  # type: ignore[no-any-return]

    def at(self, step: int, phase: str) -> None:
        fault = self._from_file() if self.path else None
        if fault is not None and step >= fault[0] and phase == fault[1]:
            self._kill()
        if self.armed and step >= self.step and phase == self.phase:
            self._kill()

    @staticmethod
    def _kill() -> None:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent; workers follow (PDEATHSIG)
        os.kill(os.getpid(), signal.SIGKILL)


def _parse(spec: str) -> tuple[int, str]:
    step, _, phase = spec.partition(":")
    phase = phase or "forward"
    if phase not in PHASES:
        raise ValueError(f"FTHSDP_FAULT phase {phase!r} is not one of {PHASES}")
    return int(step), phase
