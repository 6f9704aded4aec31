"""One rank of a replica group fails alone (issue 40): its siblings and its torchrun agent live on. 3 replicas x 2
ranks; rank 1 of replica 1 is SIGSTOPped for 30 s, or SIGKILLed, from outside. That replica must restart as a whole,
the others never exit and end with it at the last step with one state, the survivors' stall for the hung rank stays
within the collective timeout + 2 s, and the lighthouse's epoch says which rank."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from fthsdp.chaos.config import ChaosConfig
from fthsdp.chaos.run import run_chaos
from fthsdp.chaos.schedule import Fault
from fthsdp.launch.recovery_metrics import Failure, recovery_metrics
from fthsdp.testing import invariants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 150
TIMEOUT_S = 4.0
"""The replicas' collective timeout (``FTHSDP_TIMEOUT``); the rank watch waits as long for a silent sibling."""


def _run(tmp_path: pathlib.Path, fault: Fault) -> dict[str, Any]:
    """Run the job through ``fault``, check what every run must show, and return the run's report."""
    cfg = ChaosConfig(seed=0, replicas=3, steps=STEPS, ranks=2, min_step_s=0.1, heartbeat_timeout_s=3.0,
                      collective_timeout_s=TIMEOUT_S, epoch_wait_s=10.0, timeout_s=360)
    result = run_chaos(cfg, tmp_path, faults=[fault])
    assert result["violations"] == [], result["violations"]
    assert [x["kind"] for x in result["injected"]] == [fault.kind], (result["injected"], result["not_fired"])
    finals = result["finals"]
    assert len(finals) == 3 and all(f is not None and f["step"] == STEPS for f in finals.values()), finals
    assert len({f["param_hash"] for f in finals.values()}) == 1, finals
    # Replica 1 restarted (its group ended); nobody else ever exited.
    assert {e["replica"] for e in result["exits"]} == {1}, result["exits"]
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    return report


def _survivors_stall(tmp_path: pathlib.Path, report: dict[str, Any]) -> float:
    """The survivors' longest gap between two commits after the fault, less the median step."""
    t_fault = next(e["t"] for e in report["events"] if e["event"] == "chaos")
    per = invariants.load_run(tmp_path, 3)
    steps = {r: invariants.steps_of(rows) for r, rows in per.items()}
    stall = recovery_metrics(steps, [Failure(t_fault, 1)], 3, warmup=5)["stall_per_failure_s"]
    assert len(stall) == 1
    return float(stall[0])


def _named(report: dict[str, Any], rank: int) -> list[str]:
    """The epochs' reasons that name that rank of replica-1."""
    return [e["reason"] for e in report["events"] if e["event"] == "epoch_seen"
            and f"rank {rank} " in (e.get("reason") or "") and "replica-1" in e["reason"]]


def test_one_rank_stopped_alone_restarts_its_replica_within_the_collective_timeout(tmp_path: pathlib.Path) -> None:
    report = _run(tmp_path, Fault("rank-hang", 10, (1,), hang_s=30.0, ranks=(1,)))
    stall = _survivors_stall(tmp_path, report)
    assert stall <= TIMEOUT_S + 2.0, f"the survivors stalled {stall:.2f} s for a rank hung 30 s"
    assert _named(report, 1), "no epoch named rank 1 of replica-1"


def test_one_rank_killed_alone_restarts_its_replica(tmp_path: pathlib.Path) -> None:
    report = _run(tmp_path, Fault("rank-kill", 10, (1,), ranks=(1,)))
    stall = _survivors_stall(tmp_path, report)
    assert stall <= TIMEOUT_S + 2.0, f"the survivors stalled {stall:.2f} s for a killed rank"
