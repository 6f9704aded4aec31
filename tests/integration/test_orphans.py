"""Orphan slots carried (issue 38; docs/design.md §7, "Orphan slots"): the survivors train a dead replica's data
slot besides their own, so every committed step trains every slot's batch. Replica groups under torchrun (Gloo,
CPU, the tiny model) with the example trainer's own loop iterating ``ft.dealt()``."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from tests.helpers.cluster_checks import check_converged, check_exactly_once, check_survivor, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def held(step: int) -> dict[int, dict[str, str]]:
    """Every group's environment for a job whose groups that train hold before ``step`` until all 3 are in it
    (``FTHSDP_FAULT_HOLD_UNTIL``): a killed one is back before the end however slow the machine."""
    return {r: {"FTHSDP_FAULT_HOLD_UNTIL": f"{step}:3"} for r in range(3)}


def _run(tmp: pathlib.Path, steps: int, kills: tuple[Kill, ...], **kw: Any) -> dict[str, Any]:
    config = ClusterConfig(replicas=3, ranks=2, steps=steps, model="tiny", kills=kills, timeout_s=240,
                           carry_orphans=True, **kw)
    return Cluster(config, tmp).run()


def test_a_dead_replicas_slot_is_trained_by_the_survivors_to_the_end_of_the_job(tmp_path: pathlib.Path) -> None:
    """3 x 2, replica 1 SIGKILLed at step 10 of 40 and cold-restarted only after the job ended: every slot's cursor
    ends at 40 (slot 1's batches 10..39 trained by replicas 0 and 2), every batch of every slot trained exactly
    once and in order, one final state on every replica, the late one's included (it took the final checkpoint)."""
    steps = 40
    report = _run(tmp_path, steps, (Kill(1, 10, "forward"),), restart_delay_s=25.0, min_step_s=0.05)
    check_converged(report, steps)
    check_survivor(tmp_path, 0, steps)
    check_survivor(tmp_path, 2, steps)
    trained = check_exactly_once(tmp_path, 3, steps)
    assert trained == {0: steps, 1: steps, 2: steps}, trained
    assert [report["final"][str(r)]["cursors"] for r in range(3)] == [[steps] * 3] * 3, report["final"]
    rows = [x.step for x in progress(tmp_path, 1) if x.event == "step" and x.step is not None]
    assert rows and max(rows) < 10, rows  # back after the end (the final checkpoint): it trained nothing after
    # One micro-batch per slot: the last holder in slot order (replica 2) carries slot 1's whole batch.
    assert report["carried"] == {"1": steps - 10}, report["carried"]
    assert report["trained_by"]["1"] == {"1": 10, "2": steps - 10}, report["trained_by"]


def test_a_replica_back_mid_job_takes_its_slot_back_at_the_carried_cursor(tmp_path: pathlib.Path) -> None:
    """3 x 2, replica 1 SIGKILLed in the exchange of step 10 (the survivors learn it mid-step: they train the step
    again under the new deal) and back from a warm standby while the others train: it catches up, the epoch that
    makes it active deals it its slot back (the others stop carrying), and it trains slot 1 from the cursor the
    carriers left. Every slot's cursor ends at the last step, every batch trained once, one final state, and only
    the killed group exited."""
    steps = 150
    report = _run(tmp_path, steps, (Kill(1, 10, "exchange"),), restart_delay_s=0.5, min_step_s=0.1,
                  warm_restarts=True, env=held(120))
    check_converged(report, steps)
    check_survivor(tmp_path, 0, steps)
    check_survivor(tmp_path, 2, steps)
    trained = check_exactly_once(tmp_path, 3, steps)
    assert trained == {0: steps, 1: steps, 2: steps}, trained
    assert [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"] == [(1, True)]
    carried = report["carried"].get("1", 0)
    back = report["trained_by"]["1"].get("1", 0)
    assert carried > 0 and back > 10 and back + carried == steps, (carried, report["trained_by"])


def test_train_step_carries_too(tmp_path: pathlib.Path) -> None:
    """The same with ``train_step(closure)`` (the example's ``--api closure``): the closure is called once per slot
    dealt, reading it through ``ft.slot`` and ``ft.cursor``; replica 1, killed in the backward of step 10 and back
    from a warm standby, catches up inside ``train_step`` (each committed step returned in order) and takes its slot
    back. Every batch of every slot trained once, every slot's cursor at the last step, one final state."""
    steps = 100
    report = _run(tmp_path, steps, (Kill(1, 10, "backward"),), restart_delay_s=0.5, min_step_s=0.1,
                  warm_restarts=True, env=held(75),
                  command=("-m", "fthsdp.examples.train", "--steps", str(steps), "--model", "tiny", "--min-step-s",
                           "0.1", "--api", "closure"))
    check_converged(report, steps)
    check_survivor(tmp_path, 0, steps)
    check_survivor(tmp_path, 2, steps)
    assert check_exactly_once(tmp_path, 3, steps) == {0: steps, 1: steps, 2: steps}
    assert [report["final"][str(r)]["cursors"] for r in range(3)] == [[steps] * 3] * 3, report["final"]
    assert [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"] == [(1, True)]
    carried = report["carried"].get("1", 0)
    back = report["trained_by"]["1"].get("1", 0)
    assert carried > 0 and back > 10 and back + carried == steps, (carried, report["trained_by"])
    joined = [x for x in progress(tmp_path, 1) if x.event == "step" and x.joined]
    assert len(joined) == 1, joined  # its catch-up's step, returned by train_step as without carrying
