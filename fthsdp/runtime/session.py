"""``with fthsdp.runtime.training() as ft:``: a ``Replica`` and the exits every trainer would otherwise write by
hand, so that a training script handles no fthsdp exception itself.

- The body ends: the replica closes (an active one first ends the job with the others, ``Replica.close``).
- ``RejoinRequired`` (this replica's state can no longer be trusted, ``Diverged`` included): the process exits
  at once with ``EXIT_REJOIN`` (closing would wait for abandoned collectives to time out; its connections close
  with it, which the lighthouse takes as its death); the launcher restarts the group, which catches up.
- ``JobFinished`` (it came back after the job ended, with no final checkpoint to take): logged, exit status 0.
- ``Terminated`` (SIGTERM, stopped at a commit boundary) is already a ``SystemExit``; anything else propagates.

Under a launcher (``FTHSDP_PROGRESS`` set: ``fthsdp run``, ``fthsdp demo``) it also writes the lines the launcher
supervises by: ``start``, ``final`` with the replica's state hash (all ranks compute it, rank 0 writes it) at the
block's end, ``job_finished``, and ``fatal`` from whichever rank one of the ``FATAL*`` errors ends.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fthsdp.runtime.config import ConfigError, RuntimeConfig
from fthsdp.runtime.errors import (
    EXIT_REJOIN,
    DigestMismatch,
    JobFinished,
    NoStateToResume,
    RejoinRequired,
    SlotConflict,
    StateMismatch,
)
from fthsdp.runtime.replica import Replica
from fthsdp.testing.progress import ProgressRow

log = logging.getLogger("fthsdp.runtime")

FATAL_AT_START = (ConfigError, NoStateToResume, StateMismatch)
"""Errors of ``Replica()`` a restart would meet again (a bad setting, no state to resume, a model that differs
from the others'): the launcher is told (a ``fatal`` line) and stops the job."""
FATAL = (SlotConflict, DigestMismatch)
"""Errors while training that a restart would meet again: two replicas on one slot, states that differ with no
majority (a ``Diverged`` replica, in the minority, rejoins instead). Other errors propagate without a ``fatal``
line, and the launcher restarts the group (a bounded number of times), as the example trainer's does."""


def _progress(**kv: Any) -> None:
    """Append a line to ``FTHSDP_PROGRESS`` (if set) for the launcher."""
    path = os.environ.get("FTHSDP_PROGRESS", "")
    if path:
        with open(path, "a") as f:
            f.write(ProgressRow.from_json({**kv, "t": time.time()}).line())


@contextmanager
def training(config: RuntimeConfig | None = None) -> Iterator[Replica]:
    """The replica of this training process (``Replica(config)``), closed at the end of the block; the rejoin
    and end-of-job exits handled (see the module's doc)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        ft = Replica(config)
    except JobFinished as e:
        log.warning("fthsdp: %s", e)
        if rank0:
            _progress(event="job_finished", step=e.step, error=str(e))
        sys.exit(0)
    except FATAL_AT_START as e:
        _progress(event="fatal", error=f"{type(e).__name__}: {e}")
        raise
    common = {"replica": ft.config.replica_index, "incarnation": ft.incarnation, "mode": "fthsdp"}
    if ft.rank == 0:  # a warm standby once released (in its first train_step)
        ft.when_registered(lambda: _progress(event="start", step=ft.step, joining=ft.joining, **common))
    try:
        yield ft
    except JobFinished as e:
        log.warning("fthsdp replica=%s rank=%d: %s", ft.config.replica_id, ft.rank, e)
        ft.close(leave=False)
        sys.exit(0)
    except RejoinRequired as e:
        log.error("fthsdp replica=%s rank=%d step=%d: %s; exiting to rejoin (status %d)", ft.config.replica_id,
                  ft.rank, ft.step, e, EXIT_REJOIN)
        sys.exit(EXIT_REJOIN)
    except FATAL as e:
        _progress(event="fatal", error=f"{type(e).__name__}: {e}", **common)
        raise
    if os.environ.get("FTHSDP_PROGRESS"):
        digest = ft.state_hash()  # a collective: every rank
        if ft.rank == 0:
            _progress(event="final", step=ft.step, param_hash=digest, **common)
    ft.close()
