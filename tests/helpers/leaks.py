"""The check that no test leaves a process behind (autouse in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import signal
import time
from collections.abc import Iterator

import pytest

from fthsdp.launch.procutil import marked, parent

LEAK_MARK = "FTHSDP_TEST_MARK"
GRACE_S = 15.0
"""How long a process a test started may take to go once the test ends."""
HELPERS = (b"from multiprocessing.resource_tracker import main", b"from multiprocessing.forkserver import main")
"""multiprocessing's own helpers: started once by the test process, they live as long as it does. Only the test
process's own are exempt: a fork server a trainer started, or a worker it forked, must end with the trainer."""
_marks = itertools.count()


def _left(mark: str) -> dict[int, bytes]:
    """The processes carrying ``mark`` that are not the test process's multiprocessing helpers, with their command
    lines."""
    found = {}
    for pid in marked(LEAK_MARK, mark):
        with contextlib.suppress(OSError):
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if not (any(h in cmd for h in HELPERS) and parent(pid) == os.getpid()):
                found[pid] = cmd
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every process a test starts has ended when the test ends: each inherits the test's mark through its
    environment, and one still alive ``GRACE_S`` after the test is ended here and fails the test, whoever started it
    (a torchrun worker outliving its agent, a server nobody stopped)."""
    mark = f"{os.getpid()}-{next(_marks)}"
    monkeypatch.setenv(LEAK_MARK, mark)
    yield
    end = time.monotonic() + GRACE_S
    while (left := _left(mark)) and time.monotonic() < end:
        time.sleep(0.1)  # polling a condition with a deadline: a killed process may take a moment to go
    if left:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{len(left)} processes the test started outlived it (ended now):\n"
                    + "\n".join(f"{pid}: {cmd.decode(errors='replace')}" for pid, cmd in left.items()))
