"""The rank watch inside a replica group (``fthsdp.runtime.siblings``): the pure silence rule, the watch over a
real ``torch.distributed`` store, and the end of a replica whose rank fell silent (in a child process: it exits)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from fthsdp.runtime.siblings import CLOSED, EXIT_RANK_LOST, SiblingWatch, Silence
from tests.helpers.lighthouse import wait_until


def _looks(s: Silence, t0: float, t1: float, readings: dict[int, int]) -> list[tuple[int, float]]:
    """Observe every 0.1 s from ``t0`` to ``t1`` with the same readings (a watcher that is not itself stopped);
    the last look's answer."""
    out: list[tuple[int, float]] = []
    for k in range(round((t1 - t0) / 0.1) + 1):
        out = s.observe(round(t0 + 0.1 * k, 6), readings)
    return out


def test_a_counter_that_moves_is_never_late() -> None:
    s = Silence((1, 2), limit_s=1.0, now=0.0)
    for k in range(1, 100):
        assert s.observe(k / 10, {1: k, 2: k}) == []


def test_a_counter_that_stops_is_late_after_the_limit_counted_from_its_last_move() -> None:
    s = Silence((1, 2), limit_s=1.0, now=0.0)
    assert _looks(s, 0.1, 0.5, {1: 1, 2: 1}) == []
    assert _looks(s, 0.6, 1.0, {1: 2, 2: 1}) == []  # rank 2 silent since 0.1 s
    assert s.observe(1.1, {1: 3, 2: 1}) == [(2, pytest.approx(1.0))]


def test_a_rank_never_seen_is_silent_since_the_watch_began() -> None:
    s = Silence((1,), limit_s=2.0, now=10.0)
    assert _looks(s, 10.1, 11.9, {}) == []
    assert s.observe(12.0, {}) == [(1, pytest.approx(2.0))]
    # Its first stamp counts as a move.
    assert s.observe(12.1, {1: 0}) == []


def test_a_closed_rank_is_no_longer_watched() -> None:
    s = Silence((1, 2), limit_s=1.0, now=0.0)
    assert s.observe(0.1, {1: CLOSED + 7, 2: 3}) == []
    assert _looks(s, 0.2, 1.1, {1: CLOSED + 7, 2: 3}) == [(2, pytest.approx(1.0))]


def test_a_watcher_that_was_stopped_itself_starts_every_clock_over() -> None:
    """The whole group (or host) paused: on waking, the watcher sees nobody moved for seconds, itself included."""
    s = Silence((1, 2), limit_s=1.0, now=0.0)
    assert s.observe(0.1, {1: 1, 2: 1}) == []
    assert s.observe(8.0, {1: 1, 2: 1}) == []  # its previous look was 7.9 s ago
    assert _looks(s, 8.1, 8.9, {1: 1, 2: 1}) == []
    assert s.observe(9.0, {1: 2, 2: 1}) == [(2, pytest.approx(1.0))]  # a rank still stopped after that is late, as ever


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Silence((1,), limit_s=0.0, now=0.0)


def _watches(world: int, limit_s: float) -> tuple[dist.HashStore, list[SiblingWatch], list[tuple[int, int, float]]]:
    store = dist.HashStore()
    fired: list[tuple[int, int, float]] = []
    watches = [SiblingWatch("r", "inc", rank, world, limit_s=limit_s,
                            on_silent=lambda r, s, me=rank: fired.append((me, r, s)),
                            store=lambda prefix: dist.PrefixStore(prefix, store)) for rank in range(world)]
    return store, watches, fired


def _count(store: dist.HashStore, rank: int) -> int:
    return int(dist.PrefixStore("fthsdp/alive/r/inc/", store).add(str(rank), 0))


def test_live_ranks_keep_each_other_watched_and_a_stopped_one_is_named() -> None:
    store, (w0, w1, w2), fired = _watches(3, limit_s=0.4)
    for w in (w0, w1, w2):
        w.start()
    try:
        # Several rounds of rank 0's watch (its counter moves once per round), nobody late.
        wait_until(lambda: _count(store, 0) >= 8, 10, what="rank 0 to watch for several rounds")
        assert fired == []
        w2._stop.set()  # rank 2 stops stamping without closing: stopped, as a SIGSTOP would
        w2._thread.join()  # type: ignore[union-attr]
        wait_until(lambda: fired, 10, what="rank 0 to name the silent rank")
        assert fired[0][:2] == (0, 2) and fired[0][2] >= 0.4
    finally:
        for w in (w0, w1, w2):
            w.close()


def test_the_other_ranks_watch_rank_0() -> None:
    store, (w0, w1), fired = _watches(2, limit_s=0.3)
    w1.start()  # rank 0 never stamps
    try:
        wait_until(lambda: fired, 10, what="rank 1 to name rank 0")
        assert fired[0][:2] == (1, 0)
    finally:
        w1.close()


def test_a_rank_that_closes_is_not_taken_for_a_silent_one() -> None:
    store, (w0, w1), fired = _watches(2, limit_s=0.3)
    w0.start()
    w1.start()
    w1.close()
    assert _count(store, 1) >= CLOSED
    try:
        start = _count(store, 0)
        # Rank 0 watches for longer than the limit (its rounds are 75 ms apart): rank 1's silence is expected.
        wait_until(lambda: _count(store, 0) >= start + 8, 10, what="rank 0 to watch past the limit")
        assert fired == []
    finally:
        w0.close()


def test_a_one_rank_group_or_a_zero_limit_watches_nothing() -> None:
    for world, limit in ((1, 1.0), (2, 0.0)):
        _, (w, *_), _ = _watches(world, limit)
        w.start()
        assert w._thread is None
        w.close()


CHILD = r"""
import logging, sys
from fthsdp.runtime.siblings import end_replica

class Client:
    def leave(self, reason):
        print("LEFT", reason, flush=True)
        return 7

def log_line(level, msg, *args):
    print("LOG", logging.getLevelName(level), msg % args, flush=True)

end_replica(Client(), [("elsewhere", 1), (sys.argv[1], int(sys.argv[2]))], log_line, 1, 3.25)
"""


def test_a_silent_rank_ends_the_replica_leaving_the_job_and_killing_the_rank_on_its_host() -> None:
    import socket

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    victim.send_signal(signal.SIGSTOP)  # stopped: only SIGKILL ends it
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, socket.gethostname(), str(victim.pid)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.returncode == EXIT_RANK_LOST, out
        assert "LEFT rank 1 silent for 3.2 s (hung or dead)" in out.stdout
        assert "LOG ERROR rank 1 silent" in out.stdout
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def test_a_process_that_is_not_a_sibling_is_never_killed() -> None:
    import socket

    from fthsdp.launch.procutil import alive, descendants

    # Not a child of the ending process's parent (this test): a grandchild, under a shell.
    holder = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' & wait"])
    wait_until(lambda: descendants(holder.pid), 10, what="the holder's child")
    pid = descendants(holder.pid)[0]
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, socket.gethostname(), str(pid)], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.returncode == EXIT_RANK_LOST, out
        assert alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        holder.kill()
        holder.wait()
