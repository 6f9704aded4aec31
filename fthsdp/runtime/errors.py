"""Typed errors of the runtime, and the exit status that asks the launcher for a restart as a joiner."""

from __future__ import annotations

EXIT_REJOIN = 75
"""Exit status of a replica whose state fell behind the others (or that was declared dead while alive): the
launcher restarts it, and it catches up as a joiner."""


EXIT_UNHEALTHY = 77
"""Exit status of a replica group whose start-up self-check failed (``fthsdp.runtime.selfcheck``): do not restart
it on this host (torchrun reports a worker's status as 1: a launcher reads the ``unhealthy`` progress line)."""


class Unhealthy(RuntimeError):
    """This replica's self-check failed before it registered: its host is reported (``FTHSDP_BLOCKLIST``) and it
    exits ``EXIT_UNHEALTHY`` instead of joining the job. ``own``: this rank found the problem (its host is the one
    to report), not another rank of the group."""

    def __init__(self, message: str, own: bool = True) -> None:
        super().__init__(message)
        self.own = own


class RejoinRequired(RuntimeError):
    """This replica's state can no longer be trusted to match the others'; restart it (exit ``EXIT_REJOIN``)."""


class FinishedWhileJoining(Exception):
    """The job finished at ``step`` while this replica asked to enter the data plane (its Ready was refused:
    ``lighthouse.errors.JobOver``), every rank told: it takes the final checkpoint in place, as a registration
    answered finished does (``fthsdp.runtime.roles``), rather than exiting to learn that in a new incarnation."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the job finished at step {step} while this replica was joining")
        self.step = step


class NoStateToResume(RuntimeError):
    """This replica would start the job over: every other replica is gone and there is no checkpoint."""


class JobFinished(RuntimeError):
    """The job completed at ``step`` before this replica came back, and no final checkpoint of that step is at hand
    (``FTHSDP_CHECKPOINT_DIR``): it must not train, and has no final state. Not a failure: stop with status 0."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class StateMismatch(RuntimeError):
    """A joiner's model, optimizer or registered state does not have the layout of the state it was sent."""


class CheckpointRejected(StateMismatch):
    """A checkpoint failed its seal (``fthsdp.runtime.checkpoint_seal``): a file differs from what its writer
    hashed, is missing or was added, or the seal is not the job's. Nothing of it was read."""


class DigestMismatch(StateMismatch):
    """Replicas that must hold bitwise-equal state do not: the state digest of the replicas (indexes) ``replicas``
    differs at ``step``. Raised on every replica when no majority agrees (nobody can tell which state is right),
    and on a joiner whose loaded snapshot does not hash like its sources' (a restart would not help): fatal."""

    def __init__(self, message: str, step: int, replicas: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.replicas = replicas


class Diverged(DigestMismatch, RejoinRequired):
    """This replica's state digest differs from the majority's: its state is corrupt. It restarts (exit
    ``EXIT_REJOIN``) and catches up from the others; they go on."""


class SlotConflict(RuntimeError):
    """Two live replicas train the same data slot (the same ``FTHSDP_REPLICA_INDEX``)."""


class Terminated(SystemExit):
    """SIGTERM: the replica wrote a checkpoint at a commit boundary (if a directory is configured) and stops."""

    def __init__(self, step: int, path: str | None) -> None:
        super().__init__(0)
        self.step = step
        self.path = path


class CheckpointFailed(RuntimeError):
    """A checkpoint written behind the steps (``fthsdp.runtime.checkpoint_writer``) failed; raised on the training
    thread at the next wait, with what the write raised as its cause. No marker was written: a resume ignores it."""
