"""``kill_group`` ends the whole tree under our child, as a torchrun agent's is: the agent starts each worker in a
session of its own, so a kill of the agent's process group alone leaves its workers behind. And a test that leaves
a process behind fails (tests/helpers/leaks.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from fthsdp.launch import priority
from fthsdp.launch.procutil import (
    GROUP_MARK,
    alive,
    descendants,
    kill_group,
    marked,
    start_group,
    wait_for_file,
    worker,
)
from tests.helpers import leaks
from tests.helpers.lighthouse import wait_until

# A parent (our child) that starts a grandchild in a new session, prints its PID and waits for a signal, as a
# torchrun agent does with its workers.
_AGENT = (
    "import signal, subprocess, sys\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
    "print(w.pid, flush=True)\n"
    "signal.pause()\n"
)


def test_kill_group_ends_a_worker_in_a_session_of_its_own() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    worker = int(proc.stdout.readline())
    try:
        assert os.getpgid(worker) == worker != proc.pid  # not in the agent's process group
        assert descendants(proc.pid) == [worker]
        kill_group(proc)
        assert proc.returncode == -signal.SIGKILL
        assert not alive(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        proc.stdout.close()


# An agent with two workers (RANK 0 and 1), each with a child of its own that inherits its RANK.
_TWO = (
    "import os, signal, subprocess, sys\n"
    "kid = ('import subprocess, sys, signal; '\n"
    "       'subprocess.Popen([sys.executable, \"-c\", \"import signal; signal.pause()\"]); signal.pause()')\n"
    "ws = [subprocess.Popen([sys.executable, '-c', kid], env={**os.environ, 'RANK': str(r)}) for r in (0, 1)]\n"
    "print(*(w.pid for w in ws), flush=True)\n"
    "signal.pause()\n"
)


def test_worker_finds_the_agents_child_of_that_rank_not_its_descendants() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TWO], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    try:
        w0, w1 = map(int, proc.stdout.readline().split())
        wait_until(lambda: len(descendants(proc.pid)) >= 4, 30, what="both workers' own children")
        assert (worker(proc.pid, 0), worker(proc.pid, 1), worker(proc.pid, 2)) == (w0, w1, None)
    finally:
        kill_group(proc)
        proc.stdout.close()


# An agent whose worker has already left its tree when the agent is killed, as one forked between kill_group's
# reading of the tree and the agent's death does: its parent exits at once, so init adopts it.
_ESCAPED = (
    "import signal, subprocess, sys\n"
    "kid = 'import os, subprocess, sys; print(subprocess.Popen([sys.executable, \"-c\", \"import signal; "
    "signal.pause()\"], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid, flush=True); os._exit(0)'\n"
    "print(subprocess.run([sys.executable, '-c', kid], capture_output=True).stdout.decode().strip(), flush=True)\n"
    "signal.pause()\n"
)


def test_kill_group_ends_a_worker_that_left_the_agents_tree(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "agent.log"
    proc = start_group([sys.executable, "-c", _ESCAPED], dict(os.environ), log)
    escaped = int(wait_for_file(log, 60, proc))
    try:
        assert escaped not in descendants(proc.pid) and alive(escaped)  # the agent's tree no longer holds it
        mark = next(e for e in pathlib.Path(f"/proc/{escaped}/environ").read_bytes().split(b"\0")
                    if e.startswith(GROUP_MARK.encode())).split(b"=")[1].decode()
        assert set(marked(GROUP_MARK, mark)) == {proc.pid, escaped}
        kill_group(proc)
        assert proc.returncode == -signal.SIGKILL
        assert not alive(escaped) and marked(GROUP_MARK, mark) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(escaped, signal.SIGKILL)


def test_kill_group_of_an_ended_child_is_a_no_op() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    kill_group(proc)
    kill_group(None)
    assert proc.returncode == 0


def test_alive_is_false_for_a_reaped_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert alive(os.getpid())
    proc.wait(timeout=60)
    assert not alive(proc.pid)


_LEAKY = '''
import subprocess, sys
from tests.helpers.leaks import no_process_left_behind  # noqa: F401

def test_leaks():
    # Up before the test ends: on a loaded host the check could otherwise see it before its exec, under the
    # test process's command line.
    p = subprocess.Popen([sys.executable, "-c", "import signal; print('up', flush=True); signal.pause()"],
                         start_new_session=True, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\\n"

def test_cleans_up():
    p = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    p.kill()
    p.wait()
'''


def test_a_process_left_behind_fails_its_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leaks, "GRACE_S", 1.0)
    pytester.makepyfile(test_inner=_LEAKY)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)  # the leak is an error in test_leaks's teardown
    result.stdout.fnmatch_lines(["*1 processes the test started outlived it*", "*signal.pause()*"])


def test_a_tree_is_lowered_and_raised_again_down_to_a_worker_in_a_session_of_its_own() -> None:
    """A warm standby's torchrun is built at a low priority and raised to the training's when released
    (``ClusterConfig.standby_nice``): the agent and its workers, each in a session (an autogroup) of its own."""
    proc = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    worker = int(proc.stdout.readline())
    try:
        tree = priority.TreePriority(proc.pid, 19)
        assert_eventually(tree.apply, "the tree lowered")  # an unprivileged caller is rate-limited: again
        expected = 19 if priority.supported() else 0  # without a way back, a launcher leaves it alone
        assert [priority.nice(p) for p in (proc.pid, worker)] == [expected, expected]
        tree.want(0)
        assert_eventually(tree.apply, "the tree raised")
        assert [priority.nice(p) for p in (proc.pid, worker)] == [0, 0]
    finally:
        kill_group(proc)
        proc.stdout.close()


def assert_eventually(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"{what}: not within {timeout}s"
        time.sleep(0.02)  # polling a condition with a deadline


@pytest.mark.parametrize(("err", "done"), [(errno.EAGAIN, False), (errno.ESRCH, True), (errno.EPERM, True)])
def test_setting_a_priority_retries_when_rate_limited_and_gives_up_on_the_rest(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, err: int, done: bool) -> None:
    """The kernel rate-limits an unprivileged caller (EAGAIN: again later); a process gone meanwhile (ESRCH) is
    done; one we may not change (EPERM) is logged and left, never a crash of the launcher."""
    def refused(*_: object, **__: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(priority, "autogroups", lambda: True)
    monkeypatch.setattr(priority, "open", refused, raising=False)
    assert priority.set_nice(os.getpid(), 19) is done
    assert ("cannot set the CPU priority" in caplog.text) is (err == errno.EPERM)
    monkeypatch.setattr(priority, "open", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "io")),
                        raising=False)
    with pytest.raises(OSError, match="io"):
        priority.set_nice(os.getpid(), 19)
