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

from fthsdp.launcher import Cluster, ClusterConfig, Kill

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp: pathlib.Path, steps: int, kills: tuple[Kill, ...] = (), replicas: int = 3,
         min_step_s: float = 0.0) -> dict[str, Any]:
    config = ClusterConfig(replicas=replicas, ranks=2, steps=steps, model="tiny", kills=kills,
                           restart_delay_s=0.5, timeout_s=240, min_step_s=min_step_s)
    return Cluster(config, tmp).run()


def _progress(tmp: pathlib.Path, replica: int) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / f"replica{replica}.progress.jsonl").read_text().splitlines()]


def _check_converged(report: dict[str, Any], steps: int) -> None:
    finals = report["final"]
    assert all(f is not None and f["step"] == steps for f in finals.values()), finals
    hashes = {f["param_hash"] for f in finals.values()}
    assert len(hashes) == 1, f"replicas diverged: {finals}"


def _check_survivor(tmp: pathlib.Path, replica: int, steps: int) -> None:
    """A survivor commits every step exactly once, in order, with a finite loss."""
    rows = [x for x in _progress(tmp, replica) if x["event"] == "step"]
    assert [x["step"] for x in rows] == list(range(steps))
    assert all(x["loss"] is not None and x["loss"] == x["loss"] and x["loss"] < 20 for x in rows)
    assert len({x["incarnation"] for x in rows}) == 1


def _check_rejoined(tmp: pathlib.Path, replica: int, report: dict[str, Any]) -> None:
    rows = [x for x in _progress(tmp, replica) if x["event"] == "step"]
    assert len({x["incarnation"] for x in rows}) >= 2, "the killed replica never came back"
    joined = [x for x in rows if x.get("joined")]
    assert joined and joined[-1]["loss"] is None  # a zero-gradient step: it received the state instead
    assert any(e["event"] == "exit" and e["replica"] == replica and e["killed"] for e in report["events"])


def test_no_failure_all_replicas_end_identical(tmp_path: pathlib.Path) -> None:
    steps = 8
    report = _run(tmp_path, steps)
    _check_converged(report, steps)
    for r in range(3):
        _check_survivor(tmp_path, r, steps)
    # Different data slots, same averaged update: losses differ across replicas, parameters do not.
    assert report["loss"]["0"] != report["loss"]["1"]


def test_kills_during_backward_and_vote_then_rejoin(tmp_path: pathlib.Path) -> None:
    steps = 320  # paced at 0.15 s (48 s at least): time enough for both to restart and rejoin on a busy machine
    report = _run(tmp_path, steps, (Kill(1, 5, "backward"), Kill(2, 6, "vote")), min_step_s=0.15)
    _check_converged(report, steps)
    _check_survivor(tmp_path, 0, steps)
    _check_rejoined(tmp_path, 1, report)
    _check_rejoined(tmp_path, 2, report)
    epochs = [e["epoch"] for e in report["events"] if e["event"] == "epoch"]
    assert epochs == sorted(set(epochs)), "epoch numbers must strictly increase"


def test_kill_during_exchange_then_rejoin(tmp_path: pathlib.Path) -> None:
    steps = 320
    report = _run(tmp_path, steps, (Kill(1, 5, "exchange"),), min_step_s=0.15)
    _check_converged(report, steps)
    for r in (0, 2):
        _check_survivor(tmp_path, r, steps)
    _check_rejoined(tmp_path, 1, report)


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
