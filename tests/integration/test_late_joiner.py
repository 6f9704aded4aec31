"""A replica that registered while the job ran and asks to enter the data plane after it ended (docs/design.md §3,
the end of the job): its Ready is refused with the job's final step (``lighthouse.errors.JobOver``), and it takes
the final checkpoint in place, as a registration answered finished does, with no exit and no restart to learn
that. Seen in CI as an extra exit of a restarted group whose Ready lost that race, and as a group that then wrote
no final state under ``train_step``. The killed group's warm standby registers at once and is held before its
Ready (``FTHSDP_FAULT_HOLD_READY``) until the others have ended the job; replica groups under torchrun (Gloo, CPU,
the tiny model)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from tests.helpers.cluster_checks import check_converged, check_survivor, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KILLED_AT = 5


def _run(tmp: pathlib.Path, steps: int, **kw: Any) -> None:
    """3 groups, group 1 killed at ``KILLED_AT`` and back from its warm standby, held before its Ready until groups 0
    and 2 have finished; then every check of a replica that took the final checkpoint in place."""
    hold = tmp / "hold" / "ready"
    hold.parent.mkdir()

    def release_once_the_others_ended(cluster: Cluster) -> None:
        if not hold.exists() and all(g.finished for g in cluster.groups if g.index != 1):
            hold.touch()

    config = ClusterConfig(replicas=3, steps=steps, model="tiny", kills=(Kill(1, KILLED_AT, "forward"),),
                           timeout_s=240, restart_delay_s=0.5, warm_restarts=True,
                           env={1: {"FTHSDP_FAULT_HOLD_READY": str(hold)}}, **kw)
    report = Cluster(config, tmp, on_tick=release_once_the_others_ended).run()

    check_converged(report, steps)  # every replica's final state at the last step, the same bits
    check_survivor(tmp, 0, steps)
    check_survivor(tmp, 2, steps)
    assert report["final"]["1"]["late"] is True, report["final"]  # its state: the final checkpoint
    # One exit, the kill: the held incarnation was registered before the end and finished in place.
    assert [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"] == [(1, True)]
    logs = "".join(p.read_text(errors="replace") for p in tmp.glob("replica1*.log"))
    assert "while this replica was joining: took its final checkpoint" in logs
    rows = progress(tmp, 1)
    assert not [x for x in rows if x.event == "step" and x.step is not None and x.step >= KILLED_AT], \
        "the held joiner trained a step"


def test_a_joiner_refused_because_the_job_ended_takes_the_final_checkpoint_in_place(tmp_path: pathlib.Path) -> None:
    """3 x 2, the trainer's own loop: every rank learns the final step from rank 0 and the loop ends as the others'
    did."""
    _run(tmp_path, 80, ranks=2, min_step_s=0.1)


def test_under_train_step_it_still_reports_the_final_state_it_took(tmp_path: pathlib.Path) -> None:
    """3 x 1, ``train_step(closure)`` (paced steps: the light lane, tests/integration/conftest.py): its next turn
    raises ``JobFinished``, which still writes the ``final`` line of the state the replica holds, and exits 0."""
    steps = 60
    _run(tmp_path, steps, ranks=1, min_step_s=0.25,
         command=("-m", "fthsdp.examples.train", "--steps", str(steps), "--model", "tiny", "--min-step-s", "0.25",
                  "--api", "closure"))
