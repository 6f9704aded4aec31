"""Devices, threads and streams for the data plane (docs/design.md §5, docs/gpu.md "NCCL semantics").

The current CUDA device is per thread: ``torch.cuda.set_device`` on the main thread does not follow into worker
threads, whose tensors, streams and NCCL communicators would otherwise land on ``cuda:0``. So every thread that
FTAR, the runtime or the catch-up start goes through ``start_thread``, which sets the device first (``None``: the
thread never touches CUDA); ``tests/unit/test_devices.py`` fails on a ``threading.Thread`` made anywhere else.

Ordering between streams is by events, never by a device-wide synchronise: ``record`` an event on the stream
that produced a tensor, ``wait_for`` it on the stream that reads it, and ``receive`` memory that another
stream allocated (the caching allocator then keeps it until this stream's work on it is done). A thread that needs
a stream of its own (a lane's worker, the catch-up's snapshot thread) takes one with ``side_stream``: once per
thread, never one that another such thread holds (``torch.cuda.Stream()`` hands out a pool of 32 streams in turn,
so a new one each time lands on other threads' streams sooner or later). On the CPU every helper is a no-op;
nothing here touches CUDA at import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
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
        try:
            target(*args)
        finally:
            _release_stream()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


POOL_TRIES = 64
"""How many streams ``side_stream`` takes from torch's pool (32 per priority) looking for one nobody holds."""
_held: set[int] = set()
_held_lock = threading.Lock()
_mine = threading.local()


def side_stream(device: torch.device) -> Any:
    """The calling thread's own stream on ``device``, made current (``None`` on the CPU): taken the first time,
    the same one after, released when a ``start_thread`` thread ends. Another thread's work (the training
    thread's compute, another lane, the snapshot thread) is never queued behind it, nor it behind theirs."""
    if device.type != "cuda":
        return None
    stream = getattr(_mine, "stream", None)
    if stream is None or stream.device != device:
        _release_stream()
        stream = _take_stream(device)
        _mine.stream = stream
    torch.cuda.set_stream(stream)
    return stream


def _take_stream(device: torch.device) -> Any:
    with _held_lock:
        for _ in range(POOL_TRIES):
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if stream.cuda_stream not in _held:
                _held.add(stream.cuda_stream)
                return stream
    raise RuntimeError(f"no stream on {device} that another fthsdp thread does not hold ({len(_held)} held)")


def _release_stream() -> None:
    stream = getattr(_mine, "stream", None)
    if stream is not None:
        with _held_lock:
            _held.discard(stream.cuda_stream)
        _mine.stream = None


def receive(event: Any, tensors: Sequence[torch.Tensor]) -> None:
    """``tensors``, produced on another stream up to ``event``, are used on the calling thread's current stream from
    here: it waits for ``event`` (``wait_for``), and the caching allocator does not hand their memory out again
    before this stream is done with them (``record_stream``)."""
    wait_for(event)
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream())


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
