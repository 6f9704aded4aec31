"""What one training step returns to the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """What ``train_step`` returns: the step it committed, and how."""

    step: int
    """The step that was committed."""
    loss: float | None
    """``train_step``: this rank's loss, or None for a joining replica (it trained nothing: it caught up). The
    trainer's own loop: this rank's loss noted with ``note_loss``, averaged over the step's contributing replicas
    (None when none was noted, or for a step this replica trained no batch in)."""
    epoch: int
    contributors: int
    joined: bool
    """True for the step in which this replica finished catching up (it loaded the state and replayed)."""
    attempts: int
    """Exchanges the step needed (1: no failure)."""
    exchange_s: float
    """From the start of backward (a joiner: of the step) until every bucket was exchanged."""
    batches: tuple[tuple[int, int], ...] = ()
    """(slot, batch index) of every slot whose batch this step trained, all replicas together."""
    lr_factor: float = 1.0
    catchup: dict[str, object] | None = None
    """For the joined step: how the catch-up went (bytes, seconds, sources, failures, replayed steps)."""
    contributed: bool = True
    """False when this replica sent zeros and trained no batch of its own: the joined step, and the one after it."""
    diverged: tuple[int, ...] = ()
    """The replicas (indexes) whose state digest differed from the majority's at this step (they restart)."""
    lr: list[float] | None = None
    """The learning rate each param group was stepped with: the scheduler's times ``lr_factor`` (the trainer's own
    loop; None from ``train_step``)."""
    slot: int | None = None
    """The data slot whose batch this replica trained in the step (a spare's, once handed one, that very step
    included); None when it trained none (``contributed`` False)."""
    carried: tuple[int, ...] = ()
    """With orphan slots carried: the slots besides its own of which this replica trained micro-batches in the
    step (``fthsdp.runtime.carry``)."""
