"""Chaos runs of real processes: the hang action stops a whole process tree, one short seeded chaos run of a real
local cluster (SIGKILL at a phase, a SIGSTOP hang, two kills at once) with every invariant of docs/design.md §8
checked (7, only the failed replica pays, included), and a small HA run (3-member etcd, 2 lighthouses, the leader
SIGKILLed during training). The pure parts (the schedule, the invariant checks) are tested in
``tests/unit/test_chaos_schedule.py`` and ``tests/unit/test_invariants.py``."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from typing import Any

import pytest

from fthsdp.chaos.config import ChaosConfig
from fthsdp.chaos.report import summary_text
from fthsdp.chaos.run import run_chaos, soak
from fthsdp.chaos.schedule import REPLICA_KINDS, schedule
from fthsdp.launch.procutil import descendants, signal_tree, state
from fthsdp.launch.progress import progress_path, read_progress
from tests.helpers.cluster_checks import check_only_failed_pays


def _wait(cond: Any, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling a condition with a deadline


def test_hang_stops_every_process_of_a_group_even_in_their_own_sessions() -> None:
    """torchrun starts its workers in new sessions: a killpg of the agent alone leaves them running (what the
    first chaos runs did). signal_tree stops the agent's group and each descendant's."""
    agent = subprocess.Popen(["bash", "-c", "setsid sleep 60 & wait"], start_new_session=True)
    try:
        # The worker exists first in the agent's group, until setsid(2) runs in it: wait for its own session (in one
        # CI run the worker was caught between the fork and setsid).
        _wait(lambda: len(d := descendants(agent.pid)) == 1 and os.getpgid(d[0]) != agent.pid,
              "the worker, in a session of its own")
        worker = descendants(agent.pid)[0]
        pgids = signal_tree(agent.pid, signal.SIGSTOP)
        assert pgids == [agent.pid, worker]
        _wait(lambda: state(agent.pid) == "T" and state(worker) == "T", "both stopped")
        signal_tree(agent.pid, signal.SIGCONT)
        _wait(lambda: state(agent.pid) != "T" and state(worker) != "T", "both continued")
    finally:
        signal_tree(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)


# --- real runs ----------------------------------------------------------------------------------------------------

SEED = 16
STEPS = 700
# Light enough for a 2-core machine yet two ranks per replica group (two lanes): a 3 s heartbeat timeout, a 5 s
# hang, a continued replica gives up waiting for an epoch that has it after 10 s (the runtime's default is 60 s).
# Forwards padded to 0.1 s: a steady compute, so the fail-slow detector must name nobody (a violation if it does).
QUICK: dict[str, Any] = {"ranks": 2, "min_step_s": 0.0, "compute_s": 0.1, "heartbeat_timeout_s": 3.0,
                         "collective_timeout_s": 4.0, "hang_s": (4.5, 5.5), "epoch_wait_s": 10.0}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_seeded_chaos_run_keeps_every_invariant(tmp_path: pathlib.Path) -> None:
    """Seed 16: a SIGKILL at the vote, a SIGSTOP hang of a whole replica group, two replica groups SIGKILLed at
    once at the exchange (3 replicas, the tiny model, paced steps). Every fault is injected, every invariant
    holds, invariant 7 included: replica 1, which no fault targets, never exits, restarts, rolls back or falls
    behind."""
    faults = schedule(SEED, 3, STEPS, hang_s=QUICK["hang_s"])
    assert [f.kind for f in faults] == ["kill", "hang", "double"]
    t0 = time.monotonic()
    # 700 paced steps: about 80 s on a quiet 2-core machine; about 250 s with a load average of 14 from other
    # test runs, where every restart (a torch import) takes 30-50 s. The timeout leaves room for the latter.
    result = run_chaos(ChaosConfig(seed=SEED, steps=STEPS, timeout_s=420, **QUICK), tmp_path)
    took = time.monotonic() - t0
    print(json.dumps({k: result[k] for k in ("injected", "not_fired", "exits", "violations", "wall_s")}, indent=1))
    assert result["violations"] == []
    assert result["fault_targets"] == [0, 2]
    report = json.loads((tmp_path / "report.json").read_text())
    assert check_only_failed_pays(tmp_path, report, 3, STEPS) == {0, 2}  # replica 1 was held to invariant 7
    assert sorted(x["kind"] for x in result["injected"]) == sorted(REPLICA_KINDS), result["not_fired"]
    assert len([e for e in result["exits"] if e["killed"]]) >= 3  # the kill and both of the double
    hung = next(x for x in result["injected"] if x["kind"] == "hang")
    assert any("exit code" in x and "[]" not in x for x in hung["fired"]), hung  # it noticed and rejoined
    print(f"chaos run took {took:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ha_leader_lighthouse_killed_training_goes_on(tmp_path: pathlib.Path) -> None:
    """3-member etcd on loopback, 2 lighthouses; the leader is SIGKILLed during training: the other takes over,
    nobody is declared dead for it, every replica finishes converged, epochs keep increasing."""
    out = soak(ChaosConfig(seed=0, replicas=2, steps=150, kinds=("lighthouse",), ha=True, lighthouses=2,
                           ranks=1, min_step_s=0.1, timeout_s=240), tmp_path, runs=1, keep=True)
    print(summary_text(out))
    result = out["results"][0]
    assert result["violations"] == []
    assert [x["kind"] for x in result["injected"]] == ["lighthouse"]
    assert result["exits"] == []  # no replica died or was declared dead for a lighthouse failover
    assert result["epochs"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replica_back_after_the_job_finished_ends_cleanly(tmp_path: pathlib.Path) -> None:
    """Replica 1 is killed 5 steps before the end and comes back 6 s later, when replica 0 has finished and left:
    the job is complete, so replica 1 trains nothing, takes replica 0's final checkpoint and ends with its state."""
    from fthsdp.launch.cluster import Cluster
    from fthsdp.launch.config import ClusterConfig, Kill

    steps = 30
    config = ClusterConfig(replicas=2, ranks=1, steps=steps, model="tiny", kills=(Kill(1, steps - 5, "forward"),),
                           restart_delay_s=6.0, timeout_s=200, min_step_s=0.05)
    report = Cluster(config, tmp_path).run()
    final = report["final"]
    assert final["0"] is not None and final["0"]["step"] == steps
    # One final state, on both replicas; replica 1's last incarnation trained nothing.
    assert final["1"] is not None and final["1"]["param_hash"] == final["0"]["param_hash"]
    assert final["1"]["step"] == steps
    rows = read_progress(progress_path(tmp_path, 1))
    last = [x.incarnation for x in rows if x.event == "start"][-1]
    assert not [x for x in rows if x.incarnation == last and x.event == "step"]
