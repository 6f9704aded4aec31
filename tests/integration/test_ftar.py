"""FTAR across real processes on Gloo/CPU: exact results, zero contributors, two lanes, SIGKILL and SIGSTOP of a
member. Each member is a ``tests/helpers/ftar_worker.py`` process; the lighthouse (with its rendezvous store) runs in
the test process."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ftar import FTARConfig
from ftar.rules import DEADLINE_SLACK_S
from lighthouse.config import LighthouseConfig
from lighthouse.membership import Policy
from lighthouse.server.app import Lighthouse
from tests.helpers.lighthouse import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = "tests.helpers.ftar_worker"
"""Run as a module from the root: run as a script, its folder would come first on the path, where
``tests/helpers/lighthouse.py`` hides the ``lighthouse`` package."""
TIMEOUT_S = 2.0  # the engines' collective deadline in these tests
WORKER_CONNECT_TIMEOUT_S = 5.0
"""The workers' rendezvous deadline for a new epoch's group (``FTARConfig(connect_timeout_s=...)`` in the
worker)."""
COLLECTIVE_S = TIMEOUT_S + DEADLINE_SLACK_S
"""The longest one collective may take before the engine gives it up."""
MOVE_ON_S = (COLLECTIVE_S + FTARConfig().blame_grace_s) + WORKER_CONNECT_TIMEOUT_S + 3 * COLLECTIVE_S
"""The longest survivors may take to get past a hung member, each stage ended by its own deadline: giving up the
collective (or sooner: the lighthouse's heartbeat timeout drops the member) and blaming it; the rendezvous of the
next epoch's group; there, the tag check and at most two redone exchanges (milliseconds unloaded, but a loaded
machine may stretch them to their deadlines). Longer means something waited past its deadline on the hung member
(the workers would otherwise wait for the next epoch up to 20 s, or for a result up to 60 s)."""
# grpc's process-wide aio poller thread is created by grpc itself, once per process; it is not ours to stop.
GRPC_THREADS = ("_poll_wrapper",)

pytestmark = pytest.mark.slow


@pytest.fixture
def lighthouse() -> Iterator[Callable[[int], str]]:
    """Start an in-process lighthouse for ``expected`` replicas; returns its address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[Lighthouse] = []

    def start(expected: int) -> str:
        policy = Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5, confirm_age_s=0.4,
                        expected_replicas=expected)
        lh = Lighthouse(LighthouseConfig(bind="127.0.0.1:0", http=None, policy=policy, tick_s=0.02))
        asyncio.run_coroutine_threadsafe(lh.start(), loop).result(30)
        started.append(lh)
        return f"127.0.0.1:{lh.port}"

    yield start
    for lh in started:
        asyncio.run_coroutine_threadsafe(lh.stop(0.1), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class Cluster:
    def __init__(self, addr: str, tmp: pathlib.Path) -> None:
        self.addr, self.tmp = addr, tmp
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, index: int, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", WORKER, "--lighthouse", self.addr, "--index", str(index),
             "--timeout", str(TIMEOUT_S), "--out", str(self.out(index)), *args],
            cwd=ROOT, env=env)

    def out(self, index: int) -> pathlib.Path:
        return self.tmp / f"r{index}.jsonl"

    def lines(self, index: int) -> list[dict[str, Any]]:
        try:
            text = self.out(index).read_text()
        except FileNotFoundError:
            return []
        return [json.loads(x) for x in text.splitlines() if x.endswith("}")]

    def results(self, index: int, lane: int = 0) -> dict[int, dict[str, Any]]:
        return {x["step"]: x for x in self.lines(index) if "step" in x and x["lane"] == lane}

    def finish(self, indices: list[int], timeout: float = 90) -> None:
        for i in indices:
            code = self.procs[i].wait(timeout)
            assert code == 0, f"replica {i} exited {code}: {self.lines(i)[-3:]}"
            done = self.lines(i)[-1]
            assert done.get("done") is True
            assert [t for t in done["threads_left"] if not any(g in t for g in GRPC_THREADS)] == [], done

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def cluster(lighthouse: Callable[[int], str], tmp_path: pathlib.Path) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []

    def make(expected: int) -> Cluster:
        c = Cluster(lighthouse(expected), tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        c.kill_all()


def test_exact_sum_and_average_four_replicas(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(4)
    for i in range(4):
        c.spawn(i, "--steps", "3")
    c.finish(list(range(4)))
    for i in range(4):
        res = c.results(i)
        assert sorted(res) == [0, 1, 2]
        for step, r in res.items():
            assert r["contributors"] == 4 and r["uniform"]
            assert r["value"] == 10.0 * (step + 1)  # 1+2+3+4, times (step+1): exact in float64
            assert r["int_value"] == 10 * (step + 1)
            assert r["epoch"] == res[0]["epoch"]


def test_zero_contributor_not_counted_in_divisor(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(4)
    for i in range(3):
        c.spawn(i, "--steps", "2", "--op", "avg")
    c.spawn(3, "--steps", "2", "--op", "avg", "--zero")
    c.finish(list(range(4)))
    for i in range(4):
        for step, r in c.results(i).items():
            assert r["contributors"] == 3
            assert r["value"] == (1 + 2 + 3) * (step + 1) / 3  # the joiner's zeros are not in the divisor
            assert r["int_value"] == 2 * (step + 1)


def test_two_lanes(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(3)
    for i in range(3):
        c.spawn(i, "--steps", "2", "--lanes", "2")
    c.finish(list(range(3)))
    for i in range(3):
        for lane in (0, 1):
            res = c.results(i, lane)
            assert sorted(res) == [0, 1]
            for step, r in res.items():
                assert r["value"] == 6.0 * (step + 1) + 3000 * lane


def _check_survivor_results(c: Cluster, survivors: list[int], steps: int, killed: int) -> None:
    full = sum(i + 1 for i in survivors + [killed])
    part = sum(i + 1 for i in survivors)
    per_step = [c.results(i) for i in survivors]
    for step in range(steps):
        got = {(r[step]["epoch"], r[step]["contributors"], r[step]["value"]) for r in per_step}
        assert len(got) == 1, f"survivors disagree on step {step}: {got}"
        epoch, contributors, value = got.pop()
        assert (contributors, value) in ((4, full * (step + 1.0)), (3, part * (step + 1.0))), (step, contributors,
                                                                                               value)
    assert per_step[0][steps - 1]["contributors"] == 3
    assert per_step[0][steps - 1]["epoch"] > per_step[0][0]["epoch"]


def test_sigkill_mid_exchange_survivors_redo_under_next_epoch(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(4)
    steps, victim = 6, 3
    for i in range(4):
        c.spawn(i, "--steps", str(steps), "--numel", "300000")
    wait_until(lambda: any(x.get("entering") == 2 for x in c.lines(victim)), 60, 0.005, "the victim to enter step 2")
    c.procs[victim].send_signal(signal.SIGKILL)
    c.procs[victim].wait(10)
    c.finish([0, 1, 2])
    _check_survivor_results(c, [0, 1, 2], steps, victim)
    # The step the victim died in was redone (attempts > 1) or finished before it died, never lost.
    r = c.results(0)[2]
    assert r["attempts"] > 1 or r["contributors"] == 4


def test_sigstop_member_others_move_on_within_timeout(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(4)
    steps, victim = 5, 3
    for i in range(4):
        c.spawn(i, "--steps", str(steps))
    wait_until(lambda: any(x.get("entering") == 2 for x in c.lines(victim)), 60, 0.005, "the victim to enter step 2")
    wait_until(lambda: all(1 in c.results(i) for i in range(3)), 30, 0.005, "survivors to finish step 1")
    c.procs[victim].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(lambda: all(3 in c.results(i) for i in range(3)), MOVE_ON_S, 0.005,
                   "survivors to move past the hung member")
        moved_on = time.monotonic() - stopped
    finally:
        c.procs[victim].send_signal(signal.SIGCONT)
        c.procs[victim].kill()
    assert moved_on < MOVE_ON_S
    c.finish([0, 1, 2])
    _check_survivor_results(c, [0, 1, 2], steps, victim)


def test_sigkill_with_inputs_reduced_in_place_asks_for_a_recompute(cluster: Callable[[int], Cluster]) -> None:
    c = cluster(4)
    steps, victim = 6, 3
    for i in range(4):
        c.spawn(i, "--steps", str(steps), "--numel", "300000", "--direct")
    wait_until(lambda: any(x.get("entering") == 2 for x in c.lines(victim)), 60, 0.005, "the victim to enter step 2")
    c.procs[victim].send_signal(signal.SIGKILL)
    c.procs[victim].wait(10)
    c.finish([0, 1, 2])
    _check_survivor_results(c, [0, 1, 2], steps, victim)
    # The kill broke an exchange (the survivors cannot finish one without the victim, and they only left its
    # epoch by a failure): its half-reduced inputs were recomputed, never redone from garbage.
    recomputed = [(i, x["recomputed"]) for i in range(3) for x in c.lines(i) if "recomputed" in x]
    assert recomputed, "no survivor recomputed: the kill broke no exchange, or one was redone from reduced inputs"
    for i, step in recomputed:
        assert c.results(i)[step]["contributors"] == 3
