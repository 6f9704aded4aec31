"""A restarted replica group that fails its start-up self-check (``fthsdp.runtime.selfcheck``; the fault hook
``FTHSDP_FAULT=STEP:selfcheck`` in its second incarnation) is kept out: it never registers, its host goes to the
blocklist, the launcher does not start it again, and the others train every step to one final state."""

from __future__ import annotations

import json
import pathlib

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from tests.helpers.cluster_checks import check_converged, check_survivor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_restart_that_fails_its_self_check_is_kept_out_and_the_others_train_on(tmp_path: pathlib.Path) -> None:
    steps = 40
    # A group's faults arm one per incarnation in step order: the kill first, the failed self-check in the restart.
    config = ClusterConfig(replicas=3, ranks=2, steps=steps, model="tiny", kills=(Kill(1, 5), Kill(1, 6, "selfcheck")),
                           restart_delay_s=0.5, timeout_s=240, min_step_s=0.05)
    report = Cluster(config, tmp_path).run()
    assert list(report["unhealthy"]) == ["1"] and "made to fail" in report["unhealthy"]["1"], report["unhealthy"]
    check_converged(report, steps)
    for r in (0, 2):
        check_survivor(tmp_path, r, steps)
    starts = [e for e in report["events"] if e["event"] == "start" and e["replica"] == 1]
    assert len(starts) == 2, starts  # the first incarnation and the one that failed its check: no third
    epochs = [e for e in report["events"] if e["event"] == "epoch"]
    after = [e for e in epochs if e["t"] > starts[1]["t"]]
    assert all("replica-1" not in e["members"] for e in after), after  # it never registered again
    (row,) = [json.loads(x) for x in (tmp_path / "blocklist.jsonl").read_text().splitlines()]
    assert row["replica"] == "replica-1" and row["host"] and "made to fail" in row["reason"]


def test_a_group_that_fails_its_self_check_at_the_start_does_not_hold_the_first_epoch(tmp_path: pathlib.Path) -> None:
    # Group 1's first incarnation fails its check, so it never registers. The lighthouse expects 3 groups; its join
    # window (5 s here; ClusterConfig's default is half the replicas' epoch wait, at most 30 s) lets the first
    # epoch form without it, before the others' FTHSDP_EPOCH_WAIT runs out. Before the window, the others waited
    # for a third group that never came until their epoch wait failed them, restart after restart.
    steps = 20
    config = ClusterConfig(replicas=3, ranks=1, steps=steps, model="tiny", kills=(Kill(1, 0, "selfcheck"),),
                           restart_delay_s=0.5, timeout_s=200, min_step_s=0.05, join_window_s=5.0)
    report = Cluster(config, tmp_path).run()
    assert list(report["unhealthy"]) == ["1"] and "made to fail" in report["unhealthy"]["1"], report["unhealthy"]
    check_converged(report, steps)
    for r in (0, 2):
        check_survivor(tmp_path, r, steps)  # trained every step, never restarted
    starts = [e for e in report["events"] if e["event"] == "start" and e["replica"] == 1]
    assert len(starts) == 1, starts  # not started again
    epochs = [e for e in report["events"] if e["event"] == "epoch"]
    assert epochs and all("replica-1" not in e["members"] for e in epochs), epochs
    assert {"replica-0", "replica-2"} <= set(epochs[0]["members"]), epochs[0]
    (row,) = [json.loads(x) for x in (tmp_path / "blocklist.jsonl").read_text().splitlines()]
    assert row["replica"] == "replica-1" and "made to fail" in row["reason"]
