"""Chaos: the seeded schedule generator (pure), the invariant checks on hand-made runs (they catch what they
claim to), one short seeded chaos run of a real local cluster (SIGKILL at a phase, a SIGSTOP hang, two kills
at once) with every invariant of DESIGN §8 checked, and a small HA run (3-member etcd, 2 lighthouses, the
leader SIGKILLed during training)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from typing import Any

import pytest

from fthsdp.testing import invariants as inv
from fthsdp.chaos.runner import (
    HA_KINDS,
    KILL_PHASES,
    KINDS,
    REPLICA_KINDS,
    STEP_PHASES,
    ChaosConfig,
    Fault,
    _descendants,
    run_chaos,
    schedule,
    signal_tree,
    soak,
    summary_text,
)

# --- the schedule ------------------------------------------------------------------------------------------------


def test_schedule_is_deterministic_for_a_seed() -> None:
    for seed in range(20):
        assert schedule(seed, 3, 400, KINDS, 8) == schedule(seed, 3, 400, KINDS, 8)
    assert len({tuple(schedule(seed, 3, 400, KINDS, 8)) for seed in range(20)}) == 20


def test_schedule_covers_every_kind_and_phase() -> None:
    for seed in range(30):
        faults = schedule(seed, 3, 400, KINDS, len(KINDS))
        assert sorted(f.kind for f in faults) == sorted(KINDS)
    phases = {f.phases[-1] for seed in range(200) for f in schedule(seed, 3, 400, ("kill",), 3)}
    assert phases == set(KILL_PHASES)
    default = schedule(0, 3, 400)
    assert sorted(f.kind for f in default) == sorted(REPLICA_KINDS)


def test_schedule_faults_are_well_formed() -> None:
    for seed in range(100):
        faults = schedule(seed, 3, 300, KINDS, 10, hang_s=(6.0, 8.0), down_s=(3.0, 5.0))
        steps = [f.step for f in faults]
        assert steps == sorted(steps) and 0 < steps[0] and steps[-1] <= 0.6 * 300
        for f in faults:
            assert all(0 <= r < 3 for r in f.replicas)
            if f.kind == "double":
                assert len(set(f.replicas)) == 2 and all(p in STEP_PHASES for p in f.phases)
            elif f.kind == "kill" and f.phases[-1] == "serve":
                assert len(set(f.replicas)) == 2 and f.phases == ("forward", "serve")
            elif f.kind == "kill":
                assert len(f.replicas) == 1 and f.phases[-1] in KILL_PHASES
            elif f.kind == "hang":
                assert len(f.replicas) == 1 and 6.0 <= f.hang_s <= 8.0
            else:
                assert f.kind in HA_KINDS and not f.replicas and 3.0 <= f.down_s <= 5.0


def test_schedule_never_plans_a_double_kill_without_a_survivor() -> None:
    assert all(f.kind != "double" for seed in range(50) for f in schedule(seed, 2, 300, REPLICA_KINDS, 6))
    with pytest.raises(ValueError):
        schedule(0, 2, 300, ("double",))
    with pytest.raises(ValueError):
        schedule(0, 1, 300, ("kill",))
    with pytest.raises(ValueError):
        schedule(0, 3, 300, ("meteor",))


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


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
        _wait(lambda: len(_descendants(agent.pid)) == 1, "the worker")
        worker = _descendants(agent.pid)[0]
        assert os.getpgid(worker) != agent.pid
        pgids = signal_tree(agent.pid, signal.SIGSTOP)
        assert pgids == [agent.pid, worker]
        _wait(lambda: _state(agent.pid) == "T" and _state(worker) == "T", "both stopped")
        signal_tree(agent.pid, signal.SIGCONT)
        _wait(lambda: _state(agent.pid) != "T" and _state(worker) != "T", "both continued")
    finally:
        signal_tree(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)


# --- the invariant checks catch what they claim to ---------------------------------------------------------------


def _run_rows(steps: int, replicas: int = 2) -> dict[int, list[dict[str, Any]]]:
    """A clean run: every replica one incarnation, committing every step with every slot's batch."""
    return {r: [{"event": "start", "replica": r, "incarnation": f"i{r}", "t": 0.0, "resumed_from": None}]
            + [{"event": "step", "replica": r, "incarnation": f"i{r}", "step": s, "loss": 1.0, "t": 1.0 + s,
                "joined": False, "batches": [[x, s] for x in range(replicas)]} for s in range(steps)]
            for r in range(replicas)}


def _report(replicas: int, steps: int, epochs: list[int], hashes: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"final": {str(r): {"step": steps, "param_hash": (hashes or ("h",) * replicas)[r]}
                      for r in range(replicas)},
            "events": [{"t": float(i), "event": "epoch", "epoch": e, "members": ["a"]} for i, e in enumerate(epochs)]}


def test_invariants_hold_on_a_clean_run() -> None:
    rows = _run_rows(5)
    assert inv.check_run(_report(2, 5, [1, 2]), rows, 5) == []


def test_invariants_catch_divergence_lost_steps_repeats_and_epochs_going_back() -> None:
    steps = 6
    assert inv.converged(_report(2, steps, [1], ("a", "b")), steps)  # diverged
    rows = _run_rows(steps)
    for r in rows.values():  # step 3 lost everywhere
        r[:] = [x for x in r if x.get("step") != 3]
    assert any("lost committed step" in v for v in inv.no_lost_step(rows, steps))
    assert inv.exactly_once(rows, steps)[1]
    rows = _run_rows(steps)
    rows[0][3]["batches"] = [[0, 1], [1, 2]]  # slot 0's batch 1 trained twice, batch 2 never
    assert inv.exactly_once(rows, steps)[1]
    rows = _run_rows(steps)
    rows[1].insert(4, dict(rows[1][2]))  # replica 1 commits step 1 again: it went backwards
    assert any("went backwards" in v for v in inv.no_lost_step(rows, steps))
    assert inv.epochs_increasing(_report(2, steps, [1, 2, 2]))
    seen = {"events": [{"t": 1.0, "event": "epoch_seen", "epoch": 5, "members": None},
                       {"t": 2.0, "event": "epoch_seen", "epoch": 4, "members": None}]}
    assert any("went back" in v for v in inv.epochs_increasing(seen))
    reused = {"events": [{"t": 1.0, "event": "epoch", "epoch": 5, "members": ["a"]},
                         {"t": 2.0, "event": "epoch_seen", "epoch": 5, "members": ["a", "b"]}]}
    assert any("reused" in v for v in inv.epochs_increasing(reused))


def test_invariants_accept_a_rejoin_and_a_resume() -> None:
    steps = 6
    rows = _run_rows(steps)
    # Replica 1 dies after step 2 and comes back joining at step 4 (a zero-gradient step), then trains on.
    rows[1] = [x for x in rows[1] if x.get("step", 0) <= 2]
    rows[1].append({"event": "start", "replica": 1, "incarnation": "j", "t": 5.5, "resumed_from": None})
    rows[1] += [{"event": "step", "replica": 1, "incarnation": "j", "step": s, "loss": None if s == 4 else 1.0,
                 "t": 1.0 + s, "joined": s == 4, "batches": [[0, s], [1, s]]} for s in (4, 5)]
    assert inv.check_run(_report(2, steps, [1, 2, 3]), rows, steps) == []
    assert inv.rejoined(rows[1], 1, {"events": [{"event": "exit", "replica": 1, "killed": True}]}) == []


# --- real runs ----------------------------------------------------------------------------------------------------

SEED = 16
STEPS = 700
# Light enough for a 2-core machine: one rank per replica group, a 3 s heartbeat timeout, a 5 s hang, a continued
# replica gives up waiting for an epoch that has it after 10 s (the runtime's default is 60 s).
QUICK: dict[str, Any] = {"ranks": 1, "min_step_s": 0.1, "heartbeat_timeout_s": 3.0, "collective_timeout_s": 4.0,
                         "hang_s": (4.5, 5.5), "epoch_wait_s": 10.0, "last_fault_at": 0.8}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_seeded_chaos_run_keeps_every_invariant(tmp_path: pathlib.Path) -> None:
    """Seed 16: a SIGKILL at the vote, a SIGSTOP hang of a whole replica group, two replica groups SIGKILLed at
    once at the exchange (3 replicas, the tiny model, paced steps). Every fault is injected, every invariant
    holds."""
    faults = schedule(SEED, 3, STEPS, hang_s=QUICK["hang_s"])
    assert [f.kind for f in faults] == ["kill", "hang", "double"]
    t0 = time.monotonic()
    # 700 paced steps: about 80 s on a quiet 2-core machine; about 250 s with a load average of 14 from other
    # test runs, where every restart (a torch import) takes 30-50 s. The timeout leaves room for the latter.
    result = run_chaos(ChaosConfig(seed=SEED, steps=STEPS, timeout_s=420, **QUICK), tmp_path)
    took = time.monotonic() - t0
    print(json.dumps({k: result[k] for k in ("injected", "not_fired", "exits", "violations", "wall_s")}, indent=1))
    assert result["violations"] == []
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


def test_fault_describe_is_readable() -> None:
    assert Fault("kill", 5, (1,), ("vote",)).describe() == "kill r1@vote step 5"
    assert "hang r2" in Fault("hang", 9, (2,), hang_s=6.5).describe()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not os.environ.get("FTHSDP_KNOWN_GAPS"), reason="a reproducer of a known gap (docs/chaos.md, "
                    "finding 3); FTHSDP_KNOWN_GAPS=1 runs it")
@pytest.mark.xfail(strict=False, reason="chaos seeds 1 and 115 (docs/chaos.md, finding 3): a replica that comes "
                   "back after every healthy replica finished cannot tell that the job is done: it stops with the "
                   "fatal 'no replica is alive to catch up from' (a joiner admitted just before the last one left "
                   "waits on its rendezvous instead); the lighthouse has no 'job finished' state and a finished "
                   "replica neither keeps serving nor leaves a final checkpoint")
def test_replica_back_after_the_job_finished_ends_cleanly(tmp_path: pathlib.Path) -> None:
    """Replica 1 is killed 5 steps before the end and comes back 6 s later, when replica 0 has finished and left:
    the job is complete (replica 0 holds the final state), so the run should end without a failure."""
    from fthsdp.testing.launcher import Cluster, ClusterConfig, Kill

    steps = 30
    config = ClusterConfig(replicas=2, ranks=1, steps=steps, model="tiny", kills=(Kill(1, steps - 5, "forward"),),
                           restart_delay_s=6.0, timeout_s=200, min_step_s=0.05)
    report = Cluster(config, tmp_path).run()
    assert report["final"]["0"] is not None and report["final"]["0"]["step"] == steps
