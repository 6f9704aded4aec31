"""The whole training state travels and is checked (issue 13), end to end on torchrun groups (Gloo, CPU, the tiny
model, one rank per replica): a joiner with an LR scheduler ends bitwise equal to the others, and a replica whose
state is silently corrupted is found by the periodic digest check within K steps, named, and sent back to catch
up (or, with no majority to tell which state is right, the job stops); a spare, which sends no digest, finds its
own corruption the same way."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill, ReplicaFailed
from tests.helpers.cluster_checks import check_converged, check_exactly_once, check_rejoined, check_survivor, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RESTART_WINDOW_STEPS = 120
"""Steps paced at 0.25 s (30 s) in the tests where a replica restarts and must rejoin before the end. These tests run
in the light lane (tests/integration/conftest.py), beside a training that fills the cores, where a cold restart
(torchrun, imports) took 47 s once: from ``HOLD_FROM`` on, the replicas that train hold between steps while one is
missing from the job and none is joining (``FTHSDP_FAULT_HOLD_UNTIL``), so the restarted one is back before the end
however slow the machine, and 60 steps (15 s) are left for its catch-up."""

HOLD_FROM = 60


def _hold(members: int) -> dict[str, str]:
    """The environment that holds a replica from ``HOLD_FROM`` until the job has ``members`` members again."""
    return {"FTHSDP_FAULT_HOLD_UNTIL": f"{HOLD_FROM}:{members}"}


def _config(**kw: Any) -> ClusterConfig:
    base: dict[str, Any] = dict(replicas=2, ranks=1, model="tiny", restart_delay_s=0.5, timeout_s=240)
    return ClusterConfig(**{**base, **kw})


@pytest.mark.parametrize("scheduler", ["cosine", "lambda"])
def test_joiner_with_a_scheduler_ends_bitwise_equal(tmp_path: pathlib.Path, scheduler: str) -> None:
    """SIGKILL a replica whose trainer hands the runtime a scheduler (``CosineAnnealingLR`` over the run, or a
    ``LambdaLR`` decaying every step); restarted, it catches up and every replica ends with one state hash, which
    covers the param groups' lr and the scheduler's state. The digest check (every 4 steps) agrees all along."""
    steps = RESTART_WINDOW_STEPS
    env = {"FTHSDP_SCHEDULER": scheduler, "FTHSDP_DIGEST_EVERY": "4", **_hold(2)}
    report = Cluster(_config(steps=steps, kills=(Kill(1, 6, "backward"),), min_step_s=0.25,
                             env={0: env, 1: env}), tmp_path).run()
    check_converged(report, steps)
    check_survivor(tmp_path, 0, steps)
    check_rejoined(tmp_path, 1, report)
    check_exactly_once(tmp_path, 2, steps)
    joined = [x for x in progress(tmp_path, 1) if x.event == "step" and x.joined]
    assert joined and joined[-1].step is not None and joined[-1].step < steps - 4, "the replica rejoined too late"
    rows = [x for r in (0, 1) for x in progress(tmp_path, r)]
    assert not [x for x in rows if x.event == "digest_mismatch" or x.extra.get("diverged")]


def test_corrupted_replica_is_named_within_k_steps_and_catches_up(tmp_path: pathlib.Path) -> None:
    """Replica 1 flips a bit of a parameter after committing step 9. The digest check every 4 steps compares the
    state before step 12: replica 1 is in the minority, says so and restarts; replicas 0 and 2 name it at step 12
    and go on. It catches up, and all three end equal."""
    steps, corrupt, every = RESTART_WINDOW_STEPS, 9, 4
    env = {"FTHSDP_DIGEST_EVERY": str(every), **_hold(3)}
    report = Cluster(_config(replicas=3, steps=steps, min_step_s=0.25,
                             env={0: env, 1: {**env, "FTHSDP_FAULT_CORRUPT": str(corrupt)}, 2: env}), tmp_path).run()
    found = [x for x in progress(tmp_path, 1) if x.event == "digest_mismatch"]
    assert len(found) == 1, found
    assert found[0].extra["replicas"] == [1] and found[0].step is not None
    assert corrupt < found[0].step <= corrupt + every
    assert "index 1" in (found[0].error or "")
    for r in (0, 2):
        named = [(x.step, x.extra["diverged"]) for x in progress(tmp_path, r) if x.extra.get("diverged")]
        assert named == [(found[0].step, [1])], named
        check_survivor(tmp_path, r, steps)
    exits = [e for e in report["events"] if e["event"] == "exit"]
    assert [(e["replica"], e["killed"]) for e in exits] == [(1, False)], exits  # it asked to rejoin; nobody else left
    rows = [x for x in progress(tmp_path, 1) if x.event == "step"]
    assert len({x.incarnation for x in rows}) == 2 and any(x.joined and x.loss is None for x in rows)
    check_converged(report, steps)


def test_two_replicas_that_differ_stop_the_job(tmp_path: pathlib.Path) -> None:
    """Two replicas, one corrupted: no majority can tell which state is right, so both stop with
    ``DigestMismatch`` at the first check after the corruption instead of training on."""
    env = {"FTHSDP_DIGEST_EVERY": "4"}
    with pytest.raises(ReplicaFailed, match="no majority"):
        Cluster(_config(steps=40, env={0: env, 1: {**env, "FTHSDP_FAULT_CORRUPT": "2"}}), tmp_path).run()
    for r in (0, 1):
        found = [x for x in progress(tmp_path, r) if x.event == "digest_mismatch"]
        assert [(x.step, x.extra["replicas"]) for x in found] == [(4, [0, 1])], found


def test_a_corrupted_spare_finds_itself_and_catches_up(tmp_path: pathlib.Path) -> None:
    """2 replicas and a spare group; the spare flips a bit of a parameter after committing step 5. It sends no
    digest (it has no slot), so it holds its own against the slots' at the next check (step 8): it differs, says so
    and restarts; the replicas see nothing wrong and go on. It catches up as a spare, and all three end equal."""
    steps, corrupt, every = RESTART_WINDOW_STEPS, 5, 4
    env = {"FTHSDP_DIGEST_EVERY": str(every), **_hold(3)}  # the two that train hold for the spare
    report = Cluster(_config(spares=1, steps=steps, min_step_s=0.25,
                             env={0: env, 1: env, 2: {**env, "FTHSDP_FAULT_CORRUPT": str(corrupt)}}), tmp_path).run()
    found = [x for x in progress(tmp_path, 2) if x.event == "digest_mismatch"]
    assert [(x.step, x.extra["replicas"]) for x in found] == [(8, [])], found
    assert "this spare's state" in (found[0].error or "")
    assert not [x for r in (0, 1) for x in progress(tmp_path, r)
                if x.event == "digest_mismatch" or x.extra.get("diverged")]
    exits = [e for e in report["events"] if e["event"] == "exit"]
    assert [(e["replica"], e["killed"]) for e in exits] == [(2, False)], exits  # it asked to rejoin; nobody else left
    for r in (0, 1):
        check_survivor(tmp_path, r, steps)
    rows = [x for x in progress(tmp_path, 2) if x.event == "step"]
    assert len({x.incarnation for x in rows}) == 2 and any(x.joined for x in rows)
    assert not any(x.contributed for x in rows)  # a spare, before and after
    check_converged(report, steps)  # the spare's final state included
