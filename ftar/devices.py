"""Devices, threads and streams for the data plane (docs/design.md §5, docs/gpu.md "NCCL semantics").

The current CUDA device is per thread: ``torch.cuda.set_device`` on the main thread does not follow into worker
threads, whose tensors, streams and NCCL communicators would otherwise land on ``cuda:0``. So every thread that
FTAR, the runtime or the catch-up start goes through ``start_thread``, which sets the device first (``None``: the
thread never touches CUDA); ``tests/unit/test_devices.py`` fails on a ``threading.Thread`` made anywhere else.

Ordering between streams is by events, never by a device-wide synchronise: ``record`` an event on the stream
that produced a tensor, ``wait_for`` it on the stream that reads it. On the CPU every helper is a no-op; nothing
here touches CUDA at import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def resolve(backend: str, device: torch.device | None) -> torch.device:
    """The device a lane's tensors live on: the CPU for Gloo; for NCCL ``device``, or the calling thread's current
    CUDA device when it is not given."""
    if backend == "gloo":
        return torch.device("cpu")
    if device is not None:
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device())


def enter(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for the CPU or ``None``)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def start_thread(target: Callable[..., object], *, name: str, device: torch.device | None,
                 args: tuple[Any, ...] = (), daemon: bool = True) -> threading.Thread:
    """Start a thread that runs ``target(*args)`` on ``device`` (``enter`` first). ``device=None`` says the thread
    never touches CUDA (sockets, the lighthouse): say so explicitly, there is no default."""

    def run() -> None:
        enter(device)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def side_stream(device: torch.device) -> Any:
    """A stream of its own for the calling thread's data-plane work on ``device``, made current (``None`` on the
    CPU). A lane's copies then neither wait behind nor hold up the compute on the default stream."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    torch.cuda.set_stream(stream)
    return stream


def record(device: torch.device) -> Any:
    """An event recorded on the calling thread's current stream of ``device`` (``None`` on the CPU): what was
    queued there so far is done once it completes."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def wait_for(event: Any) -> None:
    """The calling thread's current stream waits (on the device, the CPU does not block) for ``event``."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
