"""Small helpers for starting and waiting on our own child processes (every wait has a deadline)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a trainer child: this process's, one thread per process (the cores are shared),
    unbuffered output, ``extra``; never a stray ``FTHSDP_FAULT`` from the caller's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("FTHSDP_FAULT", None)
    return env


def torchrun(nproc: int, *, max_restarts: int = 0) -> list[str]:
    """The command line of a standalone torchrun of ``nproc`` workers (the module and its flags follow)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts)]


GROUP_MARK = "FTHSDP_GROUP_MARK"
"""An environment variable unique to each process tree ``start_group`` starts; every process of the tree inherits
it, so ``kill_group`` finds one that left the tree (a worker the agent forked as it was being killed)."""


def start_group(cmd: list[str], env: dict[str, str], log_path: pathlib.Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (a torchrun agent) in a session of its own, its output appended to ``log_path`` and its
    environment marked (``GROUP_MARK``) for ``kill_group``."""
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env={**env, GROUP_MARK: uuid.uuid4().hex}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


class ProcessDied(RuntimeError):
    """A child process exited while we were waiting for it to become ready."""


def wait_for_file(path: pathlib.Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    """Wait until ``path`` exists with a complete last line; return its text. Raises on deadline or if
    ``proc`` exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            text = path.read_text()
            if text.endswith("\n"):
                return text.strip()
        if proc is not None and proc.poll() is not None:
            raise ProcessDied(f"process {proc.pid} exited with {proc.returncode} before writing {path}")
        time.sleep(0.02)  # polling a condition with a deadline
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Write ``text`` (newline-terminated) so readers never see half of it."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM our own child, then SIGKILL at the deadline; return its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...); None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` ended, not reaped...); None: no such process."""
    fields = _stat(pid)
    return fields[0] if fields else None


def session(pid: int) -> int:
    """The id of the session ``pid`` is in (-1: no such process)."""
    fields = _stat(pid)
    return int(fields[3]) if fields else -1


def parent(pid: int) -> int:
    """The parent of ``pid`` (-1: no such process)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else -1


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    return state(pid) not in (None, "Z")


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, from /proc (torchrun's workers run in their own sessions: a ``killpg`` of the agent's
    group does not reach them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (fields := _stat(d)):
            children.setdefault(int(fields[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def worker(agent: int, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` under the agent ``agent`` (a child of it whose environment holds
    ``RANK=<rank>``; its own children, a DataLoader's fork server say, inherit that but are not the agent's), or
    None if there is none."""
    needle = b"\0RANK=" + str(rank).encode() + b"\0"
    for c in descendants(agent):
        if parent(c) != agent:
            continue
        with contextlib.suppress(OSError):
            if needle in b"\0" + pathlib.Path(f"/proc/{c}/environ").read_bytes():
                return c
    return None


def signal_groups(pgids: list[int], sig: int) -> None:
    """Send ``sig`` to each process group (one that is gone already is skipped)."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def signal_tree(pid: int, sig: int, below: list[int] | None = None) -> list[int]:
    """Send ``sig`` to the process group of ``pid`` (a torchrun agent started in its own session) and to the
    process group of each of its descendants (the workers; ``below`` if the caller has them already); returns the
    groups signalled, agent's first."""
    pgids = [pid]
    for c in descendants(pid) if below is None else below:
        try:
            g = os.getpgid(c)
        except ProcessLookupError:
            continue
        if g not in pgids:
            pgids.append(g)
    signal_groups(pgids, sig)
    return pgids


def kill_group(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGKILL our own child (started with ``start_new_session``), its process group and every descendant, then
    wait until all of them have ended. A torchrun agent starts each worker in a session of its own, so killing
    the agent's group alone leaves a worker behind that has not yet tied its life to the agent's
    (``fthsdp.runtime.startup.die_with_parent``). And a worker the agent forks between our reading of its tree
    and its death is in neither, nor does it die with the agent (its parent is init by the time it asks to):
    for a child ``start_group`` started, every process carrying its mark is killed too, until none is left."""
    if proc is None or proc.poll() is not None:
        return
    mark = _mark(proc.pid)
    below = descendants(proc.pid)  # to wait for: once the agent is gone they belong to init
    signal_tree(proc.pid, signal.SIGKILL, below)
    proc.wait()
    end = time.monotonic() + timeout
    while (left := [p for p in below if alive(p)] + (marked(GROUP_MARK, mark) if mark else [])):
        if time.monotonic() > end:
            raise TimeoutError(f"processes {left} under {proc.pid} outlived SIGKILL")
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.01)  # polling a condition with a deadline


def _mark(pid: int) -> str | None:
    """The ``GROUP_MARK`` in live process ``pid``'s environment, if any."""
    with contextlib.suppress(OSError):
        for entry in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(GROUP_MARK.encode() + b"="):
                return entry.split(b"=", 1)[1].decode()
    return None


def run_to_completion(cmd: list[str], env: dict[str, str], log_path: pathlib.Path, timeout_s: float,
                      what: str) -> None:
    """Run ``cmd`` in its own session, output appended to ``log_path``, until it exits (its process group is
    killed at the end either way); raise if it fails or outlasts ``timeout_s``."""
    proc = start_group(cmd, env, log_path)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what} did not finish in {timeout_s}s (log: {log_path})") from None
    finally:
        kill_group(proc)
    if code != 0:
        raise RuntimeError(f"{what} exited with {code} (log: {log_path})")


def marked(name: str, value: str) -> list[int]:
    """The live processes of this user whose environment holds ``name=value``: those a test started carry the
    test's mark (tests/helpers/leaks.py), so one left behind is found whoever started it."""
    needle = f"{name}={value}".encode() + b"\0"
    found = []
    for env in pathlib.Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if (b"\0" + env.read_bytes()).find(b"\0" + needle) >= 0 and int(env.parent.name) != os.getpid():
                found.append(int(env.parent.name))
    return [p for p in found if alive(p)]
