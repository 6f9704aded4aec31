"""The trainer-facing runtime: FSDP2 inside the replica, FTAR across replicas, and the commit protocol.

``Replica`` (``replica``) is the front object, on one step core (``core``: the context built whole; settle, vote,
commit, after-commit) and a role that takes each step and names the next (``roles``: standby, joining, caught up,
spare, active, finished; their steps in ``standby``, ``catching_up`` and ``spares``), driven by the trainer's loop or
``train_step`` (``iteration``, ``loop``); beside it: ``buckets`` (the bucket plan, the FSDP2 hook, the bucket
tag), ``commit`` (the commit protocol, a pure state machine), ``join`` (catching up), ``state`` (the state layout,
snapshot and hash), ``trainer_state`` (param groups and registered objects, as JSON), ``digest`` (the periodic
digest's packing and verdict, pure) and ``agreement`` (driving it), ``startup`` (taking a place in the job),
``result`` (what a step returns), ``selfcheck`` (the start-up test of a host), ``timeline`` (every step's phases,
for ``fthsdp trace``), ``errors``, ``config`` (the settings, read from the environment), ``lr``,
``checkpoint`` and ``metrics``; for the trainer: ``session`` (``training()``: the replica and the exits a trainer
would otherwise write) and ``data`` (which batch each rank of each replica trains next)."""

from fthsdp.runtime.data import SlotSampler, batch_index, next_batch
from fthsdp.runtime.errors import (
    EXIT_REJOIN,
    EXIT_UNHEALTHY,
    DigestMismatch,
    Diverged,
    JobFinished,
    NoStateToResume,
    RejoinRequired,
    SlotConflict,
    StateMismatch,
    Terminated,
    Unhealthy,
)
from fthsdp.runtime.replica import Replica
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.session import init, training
from fthsdp.runtime.trainer_state import UnencodableState

__all__ = ["EXIT_REJOIN", "EXIT_UNHEALTHY", "DigestMismatch", "Diverged", "JobFinished", "NoStateToResume",
           "RejoinRequired", "Replica", "SlotConflict", "SlotSampler", "StateMismatch", "StepResult", "Terminated",
           "UnencodableState", "Unhealthy", "batch_index", "init", "next_batch", "training"]
