"""Wait for a file to appear without spinning: a warm standby waits for its gate file for as long as the job runs
(``fthsdp.runtime.startup.hold_as_standby``), in every rank of every standby, on hosts whose CPU trains.

On Linux the wait sleeps in ``poll`` on an inotify descriptor that watches the file's folder for new files (the
standard library has no inotify; ``ctypes`` reaches libc's), and looks again at least every ``RECHECK_S`` whatever
it is told; elsewhere, or when inotify is unavailable (the folder does not exist yet, or the user's inotify
instances are used up), it looks every ``POLL_S``."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import sys
import time

POLL_S = 0.05
"""How often the fallback looks (a release costs up to this much)."""
RECHECK_S = 1.0
"""With inotify, the longest sleep between two looks (a safety net: an event is never needed to see the file)."""
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80
"""A file created in the folder, or moved into it: all the wait needs (it only asks whether the file exists)."""


def _inotify(folder: str) -> int | None:
    """A non-blocking inotify descriptor watching ``folder`` for new files; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")  # as die_with_parent's prctl
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(folder), _IN_CREATE | _IN_MOVED_TO) < 0:
        os.close(fd)
        return None
    return fd


def wait_until_exists(path: str) -> None:
    """Return once ``path`` exists. No deadline: the caller's process ends with its job (a standby ends with its
    torchrun agent)."""
    fd = _inotify(os.path.dirname(os.path.abspath(path)))
    if fd is None:
        while not os.path.exists(path):
            time.sleep(POLL_S)  # no inotify: a stat every POLL_S
        return
    try:
        events = select.poll()  # not select(): a CUDA process may hold descriptors past 1024
        events.register(fd, select.POLLIN)
        while not os.path.exists(path):  # watched before this first look: a file made after it is an event
            if events.poll(RECHECK_S * 1000):
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 65536)  # drain: any new file in the folder wakes us; the look above decides
    finally:
        os.close(fd)
