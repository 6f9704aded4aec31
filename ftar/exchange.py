"""The values of an FTAR exchange (docs/design.md §5): the engine's settings, a request as queued, its result and the
handle the caller waits on."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ftar import devices
from lighthouse.epoch_view import EpochView

OPS = ("avg", "sum")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class FTARConfig:
    """Deadlines and limits of a lane engine."""

    backend: str = "gloo"
    """``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors)."""
    timeout_s: float = 5.0
    """Deadline of one collective (and of the data plane's own timeout): a hung peer is given up after this."""
    connect_timeout_s: float = 10.0
    """Deadline of the rendezvous of a new epoch's group."""
    epoch_wait_s: float = 30.0
    """How long to wait for the next epoch after a failure."""
    blame_grace_s: float = 0.2
    """After a failure, how long to wait for the other members to check in before blaming those that did not."""
    max_attempts: int = 10
    """Epochs an exchange is tried in before it gives up."""
    hold: bool = False
    """Keep every result this lane acted on until ``LaneEngine.forget_before``, so that members that lost them can
    be served by this one (step reconciliation, ``ftar.reconcile``); costs one more copy of what is exchanged."""
    abandon_grace_s: float = 1.0
    """A collective in flight when a newer epoch that keeps all of its members arrives gets this long to finish
    before it is abandoned (one that lost a member is abandoned at once)."""
    device: torch.device | None = None
    """The CUDA device of this lane (``nccl``); ``None``: the current device of the thread that makes the engine.
    Every thread of the lane sets it (the current device is per thread)."""
    before_collective: Callable[[int], None] | None = None
    """A fault hook: called on the lane's thread with the exchange's tag before each collective it starts (a test's
    slow link sleeps there; ``fthsdp.runtime.faults``). None: nothing."""

    def starting(self, tag: int) -> float:
        """A collective tagged ``tag`` starts: run ``before_collective``, then return the clock it starts at."""
        if self.before_collective is not None:
            self.before_collective(tag)
        return time.perf_counter()


@dataclass(frozen=True)
class ExchangeResult:
    """A completed exchange."""

    tensors: list[torch.Tensor]
    """The averaged (or summed) tensors: new tensors, the inputs are not modified."""
    epoch: int
    """The epoch the result was computed in."""
    contributors: int
    """How many replicas contributed (zero-gradient joiners are not counted): the divisor of ``avg``."""
    attempts: int
    tag: int
    """The tag (step) the members agreed on: a joiner that called with ``tag=None`` learns it here."""
    ready: Any = None
    """On CUDA, the event after which ``tensors`` hold the result (they were written on the lane's stream):
    ``Handle.wait`` makes the caller's current stream wait for it. ``None`` on the CPU."""
    in_collective_s: float = 0.0
    """Seconds this member spent inside the collective that produced it, from starting it to its end (0: served
    from a partner's kept result). The member the others wait for arrives last and waits least: a slow link's
    evidence (``lighthouse.stragglers.assess_links``)."""


class Handle:
    """A pending exchange."""

    def __init__(self, future: Future[ExchangeResult]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def when_done(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(failed)`` once the exchange ends (at once if it has; else on the thread that ends it): a
        timeline's end of the exchange, without waiting for it."""
        self._future.add_done_callback(lambda f: fn(f.cancelled() or f.exception() is not None))

    def wait(self, timeout: float | None = None) -> ExchangeResult:
        """The result; raises the exchange's ``FTARError``, or ``TimeoutError`` at the deadline. On CUDA the
        calling thread's current stream is ordered after the result (by its event: the CPU does not block), and
        the result's memory, allocated on the lane's stream, is kept until this stream is done with it."""
        result = self._future.result(timeout)
        devices.receive(result.ready, result.tensors)
        return result


@dataclass
class Request:
    """An exchange as queued for the lane's worker (the arguments of ``LaneEngine.allreduce``)."""

    tensors: list[torch.Tensor]
    contribute: bool
    op: str
    tag: int | None
    inplace: bool
    keep_inputs: bool
    redo: bool
    new_epoch_ok: bool
    future: Future[ExchangeResult]
    ready: Any = None
    """On CUDA, an event recorded on the stream that produced ``tensors``: the lane's stream waits for it."""
    fits: Callable[[EpochView], bool] | None = None
    """Whether the contribution may be exchanged in an epoch's group (None: in any; ``LaneState.misfit``)."""
