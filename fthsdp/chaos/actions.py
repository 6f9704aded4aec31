"""The fault actions of a chaos run that signal processes: stopping, continuing or killing a whole replica group
(a torchrun agent and its workers, which torchrun starts in sessions of their own) and killing a lighthouse."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, from /proc (torchrun's workers run in their own sessions: a ``killpg`` of the agent's
    group does not reach them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def signal_groups(pgids: list[int], sig: int) -> None:
    """Send ``sig`` to each process group (one that is gone already is skipped)."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to the process group of ``pid`` (a torchrun agent started in its own session) and to the
    process group of each of its descendants (the workers); returns the groups signalled, agent's first."""
    pgids = [pid]
    for c in descendants(pid):
        try:
            g = os.getpgid(c)
        except ProcessLookupError:
            continue
        if g not in pgids:
            pgids.append(g)
    signal_groups(pgids, sig)
    return pgids


def kill_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL our own child (a lighthouse) and reap it."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
