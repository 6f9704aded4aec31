"""When a collective in flight is done, failed, or to be aborted (docs/design.md §5, docs/gpu.md "NCCL semantics").

Gloo and NCCL say "done" differently. A Gloo work's future completes when the data is reduced, with the error if
it failed. An NCCL work's future (and ``wait()``) completes once the collective is *queued* on the communicator's
stream: the data is reduced only when the stream gets there, and a failure (a peer died, torchft or NCCL's
watchdog aborted the communicator) shows in the group's error state, possibly after an abort let the stream run
on over a half-reduced buffer. So a watcher reports what it sees (``Progress``) and one pure rule
(``outcome``) decides, with the lane's deadline and epoch verdict (``ftar.rules.CollectiveWatch``):

- an error, whenever it shows, fails the attempt: the buffer is never read (even if the stream completed);
- done only when the work is queued, the device finished it, and no error is recorded;
- otherwise the deadline or a pushed epoch aborts the communicator (NCCL's per-operation timeout is cleared by
  torchft's option hook, so this watcher is what bounds a collective), else keep waiting.

``FutureWatcher`` is Gloo's; ``StreamWatcher`` is NCCL's: a CUDA event recorded on the lane's stream after the
collective (the stream waits for it on the device), ``event.query()`` polled by the CPU, and after it the group's
error state (torchft's ``_errored``, then c10d's ``get_error``: ``ftar.group.EpochGroup.error``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ftar.rules import Verdict

FIRST_POLL_S = 0.0001
POLL_S = 0.002
"""An NCCL watcher polls its event after ``FIRST_POLL_S``, then twice as late each time up to this (a Gloo
watcher sleeps until its future completes or the lane wakes it)."""


class Outcome(enum.Enum):
    """What to do with a collective in flight."""

    DONE = "done"
    """Reduced without error: read the buffer."""
    WAIT = "wait"
    FAILED = "failed"
    """The group or the work recorded an error: a peer is to blame, the buffer is garbage."""
    ABORT_DEADLINE = "abort_deadline"
    """Past its deadline: abort the communicator, a peer is to blame."""
    ABORT_EPOCH = "abort_epoch"
    """A newer epoch (or closing, or exclusion) gives it up: abort the communicator, nobody is to blame."""


@dataclass(frozen=True)
class Progress:
    """What a watcher sees of one collective."""

    enqueued: bool
    """The work was handed to the backend (Gloo: its future completed)."""
    complete: bool
    """The device (or Gloo) finished it."""
    errored: bool
    """The work or its group recorded an error (an abort included)."""


def outcome(progress: Progress, verdict: Verdict) -> Outcome:
    """The rule (see the module's docstring): an error first, then completion, then the deadline, then the epoch."""
    if progress.errored:
        return Outcome.FAILED
    if progress.enqueued and progress.complete:
        return Outcome.DONE
    if verdict is Verdict.DEADLINE:
        return Outcome.ABORT_DEADLINE
    if verdict is Verdict.ABANDON:
        return Outcome.ABORT_EPOCH
    return Outcome.WAIT


class Watcher(Protocol):
    """Watches one collective."""

    def poll(self) -> Progress: ...

    def pause(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds, or less once there may be progress or the lane's ``wake`` event is set
        (a pushed epoch, exclusion, closing)."""

    def error(self) -> str:
        """Why it failed (once ``poll`` said so)."""


class FutureWatcher:
    """Gloo: the work's future completes when the data is reduced, with the error if any. The lane's thread sleeps
    on ``wake`` (set by the future's completion and by the lane on a pushed epoch, exclusion or closing): no
    polling while a collective waits for its peers."""

    def __init__(self, work: Any, wake: threading.Event) -> None:
        self._future = work.get_future()
        self._done = threading.Event()
        self._wake = wake
        self._future.add_done_callback(self._completed)

    def _completed(self, _: Any) -> None:
        self._done.set()
        self._wake.set()

    def poll(self) -> Progress:
        if not self._done.is_set():
            return Progress(False, False, False)
        failed = self._exception() is not None
        return Progress(True, not failed, failed)

    def _exception(self) -> BaseException | None:
        try:
            self._future.wait()
        except Exception as e:  # the collective's error, delivered by its future
            return e
        return None

    def pause(self, timeout: float) -> None:
        self._wake.wait(timeout)

    def error(self) -> str:
        e = self._exception()
        return f"collective error: {str(e).splitlines()[0][:300] if e else 'unknown'}"


class StreamWatcher:
    """NCCL: the current stream waits (on the device) for the work, then ``record()`` puts an event behind it; the
    work is complete when the event is, and failed when ``errors()`` (the group's error state: torchft's flag, then
    c10d's ``get_error``) names one.

    The event is read before the error state: an abort sets the error first and then lets the stream run on over a
    half-reduced buffer, so an event seen complete with no error after it is a real completion. (Read the other way,
    an abort between the two reads would pass a half-reduced buffer as done.) The work's own ``is_success()`` is not
    asked: ``ProcessGroupNCCL`` does not implement it (it raises), nor ``exception()`` (its binding raises)."""

    def __init__(self, work: Any, errors: Callable[[], str | None], record: Callable[[], Any],
                 wake: threading.Event | None = None) -> None:
        self._wake = wake or threading.Event()
        work = getattr(work, "_work", None) or work  # torchft wraps the backend's work (its wait arms a timer)
        self._errors = errors
        self._why = ""
        self._next_pause = FIRST_POLL_S
        try:
            work.wait()  # the current stream waits for the collective: a device-side wait, the CPU goes on
        except Exception as e:  # already failed (an aborted communicator)
            self._why = str(e) or repr(e)
        self._event = record()

    def poll(self) -> Progress:
        complete = bool(self._event.query())  # first: see the class docstring
        errored = self._errored()
        return Progress(True, complete and not errored, errored)

    def _errored(self) -> bool:
        if not self._why:
            self._why = self._errors() or ""
        return bool(self._why)

    def pause(self, timeout: float) -> None:
        self._wake.wait(max(0.0, min(timeout, self._next_pause)))  # the device has no callback into this thread: poll
        self._next_pause = min(self._next_pause * 2, POLL_S)

    def error(self) -> str:
        return (self._why or "collective error").splitlines()[0][:300]
