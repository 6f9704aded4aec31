"""A replica that registered while the job ran and asks to enter the data plane after it ended (docs/design.md §6,
"Joining"): its Ready is refused with the job's final step (``lighthouse.errors.JobOver``), and it takes the final
checkpoint in place, as a registration answered finished does, with no exit and no restart to learn that. Seen in
CI as an extra exit of a restarted group whose Ready lost that race. 3 replica groups x 2 ranks under torchrun
(Gloo, CPU, the tiny model); the killed group's warm standby registers at once and is held before its Ready
(``FTHSDP_FAULT_HOLD_READY``) until the others have ended the job."""

from __future__ import annotations

import pathlib

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from tests.helpers.cluster_checks import check_converged, check_survivor, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 60
KILLED_AT = 5


@pytest.mark.parametrize("api", ["loop", "closure"])
def test_a_joiner_refused_because_the_job_ended_takes_the_final_checkpoint_in_place(tmp_path: pathlib.Path,
                                                                                    api: str) -> None:
    """The trainer's own loop ends as the others' did; ``train_step``'s next turn raises ``JobFinished``, which
    still reports the final state the replica holds (a ``final`` line, exit 0)."""
    hold = tmp_path / "hold" / "ready"
    hold.parent.mkdir()

    def release_once_the_others_ended(cluster: Cluster) -> None:
        if not hold.exists() and all(g.finished for g in cluster.groups if g.index != 1):
            hold.touch()

    config = ClusterConfig(replicas=3, ranks=2, steps=STEPS, model="tiny", kills=(Kill(1, KILLED_AT, "forward"),),
                           timeout_s=240, restart_delay_s=0.5, warm_restarts=True, min_step_s=0.1,
                           env={1: {"FTHSDP_FAULT_HOLD_READY": str(hold)}},
                           command=("-m", "fthsdp.examples.train", "--steps", str(STEPS), "--model", "tiny",
                                    "--min-step-s", "0.1", "--api", api))
    report = Cluster(config, tmp_path, on_tick=release_once_the_others_ended).run()

    check_converged(report, STEPS)  # every replica's final state at the last step, the same bits
    check_survivor(tmp_path, 0, STEPS)
    check_survivor(tmp_path, 2, STEPS)
    assert report["final"]["1"]["late"] is True, report["final"]  # its state: the final checkpoint
    # One exit, the kill: the held incarnation was registered before the end and finished in place.
    assert [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"] == [(1, True)]
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("replica1*.log"))
    assert "while this replica was joining: took its final checkpoint" in logs
    rows = progress(tmp_path, 1)
    assert not [x for x in rows if x.event == "step" and x.step is not None and x.step >= KILLED_AT], \
        "the held joiner trained a step"
