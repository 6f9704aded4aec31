"""How a replica group's death reaches the lighthouse, with real processes holding sessions (``fthsdp emulate``):
a killed process's session closes with it, so a peer's report is confirmed at once (no silence waited for); a hung
(SIGSTOPped) one keeps its connection open and is still declared dead by silence, within the heartbeat timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from fthsdp.launch.procutil import stop_process
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.events import DeathCause, Died
from tests.helpers.lighthouse import JOB, ServerThread, wait_until

POLICY = m.Policy(min_replicas=1, expected_replicas=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                  confirm_age_s=1.0)
GROUP = "emu-00000"


@pytest.fixture
def pair(start_server: Callable[..., ServerThread]) -> Iterator[tuple[ServerThread, LighthouseClient,
                                                                     subprocess.Popen[bytes]]]:
    """A lighthouse, one in-test replica ("a") and one emulated replica group of 8 ranks in its own process."""
    server = start_server(POLICY)
    proc = subprocess.Popen([sys.executable, "-m", "fthsdp", "emulate", "--lighthouse", server.addr, "--replicas",
                             "1", "--ranks", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a = LighthouseClient(server.addr, JOB, "a")
    try:
        a.start(deadline_s=60)
        wait_until(lambda: (e := a.epoch) is not None and set(e.replica_ids) == {"a", GROUP}, timeout=60,
                   what="the first epoch with both")
        # One connection and one session for the 8-rank group, as for "a".
        wait_until(lambda: server.on_loop(lambda: server.lh.metrics.sessions._value.get()) == 2, timeout=30,
                   what="two sessions open")
        yield server, a, proc
    finally:
        a.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop_process(proc)


def _death(server: ServerThread) -> Died:
    state = wait_until(lambda: (st := server.state()).epoch is not None and st.epoch.member(GROUP) is None and st,
                       timeout=30, what=f"{GROUP} declared dead")
    return next(e for e in state.epoch.events if isinstance(e, Died) and e.replica_id == GROUP)


def test_a_killed_groups_session_closes_and_a_report_is_confirmed_at_once(
        pair: tuple[ServerThread, LighthouseClient, subprocess.Popen[bytes]]) -> None:
    server, a, proc = pair
    epoch = a.epoch
    assert epoch is not None
    proc.kill()
    proc.wait(timeout=10)
    wait_until(lambda: server.on_loop(lambda: server.lh.jobs[JOB].disconnected_s(GROUP, 1e12)) is not None,
               timeout=10, what="the lighthouse to see the session close")
    result = a.report_failure(GROUP, epoch.number, "lane timeout")
    assert result.confirmed
    died = _death(server)
    assert died.cause == DeathCause.DISCONNECTED and died.silent_s < POLICY.confirm_age_s


def test_a_hung_group_keeps_its_connection_and_is_declared_dead_by_silence(
        pair: tuple[ServerThread, LighthouseClient, subprocess.Popen[bytes]]) -> None:
    server, a, proc = pair
    os.kill(proc.pid, signal.SIGSTOP)
    died = _death(server)
    assert died.cause == DeathCause.TIMEOUT and died.silent_s > POLICY.heartbeat_timeout_s
    # Its connection never closed: no evidence but the silence.
    assert server.on_loop(lambda: server.lh.jobs[JOB].disconnected_s(GROUP, 1e12)) is None
