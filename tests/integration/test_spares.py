"""A hot spare end to end (docs/design.md §7, "Spares"; issue 17): 2 replicas x 2 ranks and 1 spare group, a SIGKILL of
replica 1. The spare takes replica 1's data slot in the epoch that drops it and contributes from the step after
the failure: the job is back to 2 contributors one step later, every batch of every slot is still trained exactly
once, and the killed replica comes back as a spare. Every group, the spare's included, ends with one state."""

from __future__ import annotations

import pathlib

import pytest

from fthsdp.testing.launcher import Cluster, ClusterConfig, Kill
from fthsdp.testing.progress import steps_of
from tests.helpers.cluster_checks import check_all, check_exactly_once, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 150
"""Paced at 0.15 s a step: over 20 s after the kill, for the killed group's warm standby to register, catch up and
train as a spare before the end."""
KILL = 10


def test_a_spare_takes_the_dead_replicas_slot_and_the_job_is_back_to_full_one_step_later(
        tmp_path: pathlib.Path) -> None:
    config = ClusterConfig(replicas=2, spares=1, ranks=2, steps=STEPS, model="tiny", kills=(Kill(1, KILL),),
                           restart_delay_s=0.5, timeout_s=240, min_step_s=0.15,
                           warm_restarts=True)
    report = Cluster(config, tmp_path).run()
    check_all(tmp_path, report, 3, STEPS)  # all three groups: one final state, invariants, epochs
    assert check_exactly_once(tmp_path, 3, STEPS) == {0: STEPS, 1: STEPS - 1, 2: 0}  # slot 1 lost one step's batch

    spare = [x for x in steps_of(progress(tmp_path, 2)) if x.step is not None]
    assert [x.step for x in spare] == list(range(STEPS))  # the spare never restarted nor fell behind
    before = [x for x in spare if x.step < KILL]
    assert before and not any(x.contributed for x in before)  # a spare trains no batch
    assert all(x.contributors == 2 for x in before)
    # The step the kill hit commits with one contributor; from the next one on the spare trains slot 1.
    short = [x.step for x in spare if x.contributors < 2]
    assert short == [KILL], short
    after = [x for x in spare if x.step > KILL]
    assert all(x.contributed and x.contributors == 2 for x in after)
    assert all(x.batches and any(s == 1 for s, _ in x.batches) for x in after)  # slot 1 trained

    # Replica 1 came back and rejoined as a spare (its slot was taken): it trains nothing once back.
    back = [x for x in steps_of(progress(tmp_path, 1)) if x.step is not None and x.step > KILL]
    assert back, "replica 1 never came back before the end"
    assert not any(x.contributed for x in back)
    exits = [e for e in report["events"] if e["event"] == "exit"]
    assert {e["replica"] for e in exits} == {1} and exits[0]["killed"], exits
