"""CPU priority of a process tree we started (a warm standby's torchrun): lowered while it is built and held,
raised again when it is released (docs/design.md §7, "Warm restarts").

Linux with autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) shares the CPU between sessions first, and
torchrun starts each worker in a session of its own, so a process's own nice value does not reach the training
processes it competes with: the session's autogroup nice (``/proc/<pid>/autogroup``) does. (Autogroups only
matter to tasks in the root CPU cgroup: under a cgroup CPU controller, a container's say, the write succeeds and
changes nothing.) Without autogroups each thread's nice value does (``setpriority``), and raising it again needs
``CAP_SYS_NICE``: a launcher without it leaves the priority alone (``supported``). The kernel lets an unprivileged
process change an autogroup's nice at most every 100 ms (``EAGAIN``): ``TreePriority.apply`` is called again until
it is done.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

from fthsdp.launch.procutil import alive, descendants, session

log = logging.getLogger("fthsdp.launch.priority")

AUTOGROUP_SWITCH = "/proc/sys/kernel/sched_autogroup_enabled"
CAP_SYS_NICE = 23


def autogroups() -> bool:
    """Whether the kernel schedules by autogroup (one per session)."""
    try:
        with open(AUTOGROUP_SWITCH) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _can_raise_nice() -> bool:
    """Whether this process has ``CAP_SYS_NICE`` (root in a container often lacks it)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caps, 16) >> CAP_SYS_NICE & 1)


def supported() -> bool:
    """Whether a lowered priority can be raised again by this process (autogroups, or ``CAP_SYS_NICE``)."""
    return autogroups() or _can_raise_nice()


def nice(pid: int) -> int:
    """Process ``pid``'s CPU priority as ``set_nice`` gives it (its autogroup's, else its main thread's)."""
    if autogroups():
        with open(f"/proc/{pid}/autogroup") as f:  # "/autogroup-123 nice 19"
            return int(f.read().split()[-1])
    return os.getpriority(os.PRIO_PROCESS, pid)


def set_nice(pid: int, value: int) -> bool:
    """Give process ``pid`` CPU priority ``value`` (its autogroup's, else each of its threads'); False: try again
    later (rate-limited). A process that is gone counts as done; so does one this process may not change
    (``EPERM``: logged, its priority stays)."""
    if not alive(pid):
        return True
    try:
        if autogroups():
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(value))
        else:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, int(tid), value)
    except (FileNotFoundError, ProcessLookupError):
        return True  # ended meanwhile
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return False
        if e.errno in (errno.EPERM, errno.EACCES):
            log.warning("cannot set the CPU priority of process %d to %d: %s", pid, value, e)
            return True
        raise
    return True


class TreePriority:
    """The wanted priority of a process tree (``root`` and its descendants, as they appear): ``apply`` brings each
    process to it, ``want`` changes it. Cheap once every process is at the wanted value and no new one appeared."""

    def __init__(self, root: int, value: int) -> None:
        self.root = root
        self.value = value
        self.applied: dict[tuple[int, int], int] = {}
        """(pid, its session) -> the nice value given to it (a process that started a session since is new)."""

    def want(self, value: int) -> None:
        """From now on the tree should run at ``value``."""
        self.value = value

    def apply(self) -> bool:
        """Give the wanted value to every process of the tree that lacks it; True when none is left to do."""
        if not supported():
            return True
        ok = True
        for pid in [self.root, *descendants(self.root)]:
            key = (pid, session(pid))
            if self.applied.get(key) == self.value:
                continue
            if set_nice(pid, self.value):
                self.applied[key] = self.value
            else:
                ok = False
        return ok
