"""``with fthsdp.runtime.training() as ft:``: a ``Replica`` and the exits every trainer would otherwise write by
hand, so that a training script handles no fthsdp exception itself.

- The body ends: the replica closes (an active one first ends the job with the others, ``Replica.close``).
- ``RejoinRequired`` (this replica's state can no longer be trusted, ``Diverged`` included): the process exits
  at once with ``EXIT_REJOIN`` (closing would wait for abandoned collectives to time out; its connections close
  with it, which the lighthouse takes as its death); the launcher restarts the group, which catches up. Unless
  the lighthouse dropped it because the job finished (its step was in flight as the others ended): then it takes
  the job's final checkpoint in place (``roles.finished_meanwhile``), writes its ``final`` line and exits 0.
- ``JobFinished`` (it came back after the job ended, with no final checkpoint to take): logged, exit status 0. One
  that holds the final checkpoint (the job ended while it asked to join, inside ``train_step``) first writes its
  ``final`` line, as the loop's end does.
- ``Unhealthy`` (the start-up self-check failed, ``fthsdp.runtime.selfcheck``): the host goes to
  ``FTHSDP_BLOCKLIST``, an ``unhealthy`` line to the launcher, exit status ``EXIT_UNHEALTHY``.
- ``Terminated`` (SIGTERM, stopped at a commit boundary) is already a ``SystemExit``; anything else propagates.

Under a launcher (``FTHSDP_PROGRESS`` set: ``fthsdp run``, ``fthsdp demo``) it also writes the lines the launcher
supervises by: ``start``, a ``step`` row per committed step (rank 0: ``step_row``, which names the data slot the
replica trained, so the launcher can say who trained what), ``final`` with the replica's state hash (all ranks
compute it, rank 0 writes it) at the block's end, ``job_finished``, and ``fatal`` from whichever rank one of the
``FATAL*`` errors ends.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, NoReturn

from torch.distributed.device_mesh import DeviceMesh

from fthsdp.launch.progress import ProgressWriter
from fthsdp.runtime import roles, selfcheck
from fthsdp.runtime.config import ConfigError, RuntimeConfig
from fthsdp.runtime.errors import (
    EXIT_REJOIN,
    EXIT_UNHEALTHY,
    DigestMismatch,
    JobFinished,
    NoStateToResume,
    RejoinRequired,
    SlotConflict,
    StateMismatch,
    Unhealthy,
)
from fthsdp.runtime.replica import Replica
from fthsdp.runtime.result import StepResult

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
    out = ProgressWriter(os.environ.get("FTHSDP_PROGRESS", ""))
    out.write(**kv)
    out.close()


def _start(config: RuntimeConfig | None, mesh: DeviceMesh | None = None) -> Replica:
    """``Replica(config)`` with the start-up exits: back after the job finished (exit 0), or a ``fatal`` line for
    an error a restart would meet again."""
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        ft = Replica(config, mesh)
    except JobFinished as e:
        log.warning("fthsdp: %s", e)
        if rank0:
            _progress(event="job_finished", step=e.step, error=str(e))
        sys.exit(0)
    except FATAL_AT_START as e:
        _progress(event="fatal", error=f"{type(e).__name__}: {e}")
        raise
    except Unhealthy as e:
        exit_unhealthy(e, config)
    if ft.rank == 0:  # a warm standby once released (in its first step)
        ft.when_registered(lambda: _progress(event="start", step=ft.step, joining=ft.joining, **_common(ft)))
        if path := os.environ.get("FTHSDP_PROGRESS", ""):  # a launcher's step rows: who trained which slot, when
            rows = ProgressWriter(path)  # held open for the process's lifetime: a row per step costs a write
            ft.on_committed = lambda r: rows.write(**step_row(r), **_common(ft))
        # The launcher starts a group's next warm standby once its incarnation committed a step as active.
        ft.on_active = lambda: _progress(event="active", step=ft.step, **_common(ft))
    return ft


def exit_unhealthy(e: Unhealthy, config: RuntimeConfig | None = None) -> NoReturn:
    """The self-check failed (``Replica()`` raised ``Unhealthy``): the host to ``FTHSDP_BLOCKLIST`` (by the rank that
    found it), an ``unhealthy`` line for the launcher (rank 0), exit ``EXIT_UNHEALTHY``."""
    log.error("fthsdp: self-check failed: %s; not joining the job (exit status %d)", e, EXIT_UNHEALTHY)
    cfg = config or RuntimeConfig.from_env()  # it was read once already: Replica() got this far
    if e.own:  # this rank's host is the one to keep out
        selfcheck.blocklist(cfg.blocklist, cfg.replica_id, str(e))
    if cfg.rank == 0:
        _progress(event="unhealthy", error=str(e))
    sys.exit(EXIT_UNHEALTHY)


def step_row(r: StepResult) -> dict[str, Any]:
    """A committed step's row for the launcher (``fthsdp.launch.progress``): what the example trainer writes too,
    less what only the trainer knows (its step time, its loss where none was noted)."""
    return {"event": "step", "step": r.step, "loss": r.loss, "epoch": r.epoch, "contributors": r.contributors,
            "joined": r.joined, "attempts": r.attempts, "exchange_s": r.exchange_s, "batches": r.batches,
            "lr_factor": r.lr_factor, "catchup": r.catchup, **({"diverged": list(r.diverged)} if r.diverged else {}),
            **({"slot": r.slot} if r.contributed and r.slot is not None else {"contributed": False}),
            **({"carried": list(r.carried)} if r.carried else {})}


def _common(ft: Replica) -> dict[str, Any]:
    return {"replica": ft.config.replica_index, "incarnation": ft.incarnation, "mode": "fthsdp"}


def _exit_for(ft: Replica, e: BaseException) -> int | None:
    """The exit status an error ends this process with (None: it propagates), after what it needs done."""
    if isinstance(e, JobFinished):
        log.warning("fthsdp replica=%s rank=%d: %s", ft.config.replica_id, ft.rank, e)
        if ft.finished:  # it holds the job's final state (the job ended while it joined, in train_step): say so
            _end(ft)
        else:
            ft.close(leave=False)
        return 0
    if isinstance(e, RejoinRequired) and ft.job_over_at is not None and not ft.finished:
        # Dropped because the job finished while its step was in flight (a joiner entering as the others ended, a
        # replica whose last step did not commit): the final state is the job's final checkpoint, not a restart's.
        try:
            roles.finished_meanwhile(ft, ft.job_over_at, f"before this replica's step committed ({e})")
        except JobFinished as over:  # no final checkpoint to take
            return _exit_for(ft, over)
        except Exception as failed:  # noqa: BLE001 - e.g. no model yet to load it into: a restart takes it then
            log.error("fthsdp replica=%s rank=%d: the job finished at step %d, and its final checkpoint could not be "
                      "taken in place (%s)", ft.config.replica_id, ft.rank, ft.job_over_at, failed)
        else:
            _end(ft)
            return 0
    if isinstance(e, RejoinRequired):
        log.error("fthsdp replica=%s rank=%d step=%d: %s; exiting to rejoin (status %d)", ft.config.replica_id,
                  ft.rank, ft.step, e, EXIT_REJOIN)
        return EXIT_REJOIN
    if isinstance(e, FATAL):
        _progress(event="fatal", error=f"{type(e).__name__}: {e}", **_common(ft))
    return None


def _end(ft: Replica) -> None:
    """The loop's end: the final state hash for a launcher (a collective: every rank), then close the replica."""
    if os.environ.get("FTHSDP_PROGRESS"):
        digest = ft.state_hash()
        if ft.rank == 0:  # with the data cursors (batches trained per slot), and whether it came back too late
            _progress(event="final", step=ft.step, param_hash=digest, cursors=ft.cursors.tolist(),
                      **({"late": True} if ft.finished else {}), **_common(ft))
    ft.close()


def init(config: RuntimeConfig | None = None, mesh: DeviceMesh | None = None) -> Replica:
    """The replica of this training process, for a trainer that keeps its own loop with no block around it:
    ``training()``'s exits become the process's. An uncaught ``RejoinRequired`` ends the process with status
    ``EXIT_REJOIN`` (the launcher restarts the group, which catches up) and ``JobFinished`` with 0 (a
    ``sys.excepthook``); the loop over ``ft.steps(total)`` closes the replica when it ends (the job's end with the
    others, the final checkpoint, the final line for a launcher). ``mesh``: the replica's device mesh, if the trainer
    built one (``Replica``)."""
    ft = _start(config, mesh)
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        status = _exit_for(ft, value)
        if status is None:
            previous(kind, value, tb)
            return
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the process's end: its sockets close, which the lighthouse takes as this replica's death

    sys.excepthook = excepthook
    ft.on_steps_end = lambda: _end(ft)
    return ft


@contextmanager
def training(config: RuntimeConfig | None = None, mesh: DeviceMesh | None = None) -> Iterator[Replica]:
    """The replica of this training process (``Replica(config, mesh)``), closed at the end of the block; the rejoin
    and end-of-job exits handled (see the module's doc)."""
    ft = _start(config, mesh)
    try:
        yield ft
    except (JobFinished, RejoinRequired, *FATAL) as e:
        status = _exit_for(ft, e)
        if status is None:
            raise
        sys.exit(status)
    _end(ft)
