"""The runtime end to end: replica groups under torchrun (Gloo, CPU, the tiny model), with SIGKILLs of whole
replica groups at chosen phases, restarts and rejoins; plus the bitwise check against plain FSDP2."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from tests.helpers.cluster_checks import check_converged, check_exactly_once, check_rejoined, check_survivor

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp: pathlib.Path, steps: int, kills: tuple[Kill, ...] = (), replicas: int = 3,
         min_step_s: float = 0.0, **kw: Any) -> dict[str, Any]:
    config = ClusterConfig(replicas=replicas, ranks=2, steps=steps, model="tiny", kills=kills,
                           restart_delay_s=kw.pop("restart_delay_s", 0.5), timeout_s=240, min_step_s=min_step_s, **kw)
    return Cluster(config, tmp).run()


def test_no_failure_all_replicas_end_identical(tmp_path: pathlib.Path) -> None:
    steps = 8
    report = _run(tmp_path, steps)
    check_converged(report, steps)
    for r in range(3):
        check_survivor(tmp_path, r, steps)
    # Different data slots, same averaged update: losses differ across replicas, parameters do not.
    assert report["loss"]["0"] != report["loss"]["1"]
    # One lighthouse stream per replica group: rank 1 of each group takes its epochs from rank 0, watching nothing.
    opened = report["lighthouse_streams_opened"]
    assert opened.get("watch", 0) == 0 and opened["session"] >= 3, opened


def test_kills_during_backward_vote_and_fetch_then_rejoin(tmp_path: pathlib.Path) -> None:
    """Two failures, then the first one's next incarnation dies mid-fetch: the survivor loses nothing, everyone
    comes back, every batch of every slot is trained exactly once."""
    steps = 120  # paced at 0.15 s; the groups that train hold before step 90 until both are back in the job
    # (``FTHSDP_FAULT_HOLD_UNTIL``), so they rejoin before the end on a busy machine, not by the pace alone.
    # A group's kills arm one per incarnation in step order: the second incarnation of replica 1 dies fetching.
    report = _run(tmp_path, steps, (Kill(1, 5, "backward"), Kill(2, 6, "vote"), Kill(1, 6, "fetch")),
                  min_step_s=0.15, env={r: {"FTHSDP_FAULT_HOLD_UNTIL": "90:3"} for r in range(3)})
    check_converged(report, steps)
    check_survivor(tmp_path, 0, steps)
    check_rejoined(tmp_path, 1, report)
    check_rejoined(tmp_path, 2, report)
    # Both of its ranks held at the hold's step (for as long as the job lacked a member, none joining), saying so.
    held = [line for line in (tmp_path / "replica0.log").read_text().splitlines() if "held before step 90 " in line]
    assert len(held) == 2, held
    exits = [e for e in report["events"] if e["event"] == "exit" and e["replica"] == 1]
    assert len(exits) == 2 and all(e["killed"] for e in exits), exits
    trained = check_exactly_once(tmp_path, 3, steps)
    assert trained[0] == steps and trained[1] < steps and trained[2] < steps
    epochs = [e["epoch"] for e in report["events"] if e["event"] == "epoch"]
    assert epochs == sorted(set(epochs)), "epoch numbers must strictly increase"


def test_one_replica_matches_plain_fsdp2_bitwise(tmp_path: pathlib.Path) -> None:
    steps = 6
    report = _run(tmp_path / "ft", steps, replicas=1)
    plain = tmp_path / "plain.jsonl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "fthsdp.examples.train", "--plain", "--model", "tiny", "--steps", str(steps),
                    "--progress", str(plain)], cwd=ROOT, check=True, timeout=240,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    plain_loss = [[x["step"], x["loss"]] for x in map(json.loads, plain.read_text().splitlines())
                  if x["event"] == "step"]
    assert report["loss"]["0"] == plain_loss  # floats compared exactly
