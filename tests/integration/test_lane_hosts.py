"""Lanes meet on their members' stores (issue 39): 3 replicas x 2 ranks, the replica that hosts lane 0's rendezvous
is SIGKILLed. The survivors rebuild every lane on the store of the next host the rule names, found from what they
kept (nothing asked of the lighthouse), and train on; only the killed replica pays; one final state."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest

from fthsdp.chaos.config import ChaosConfig
from fthsdp.chaos.run import run_chaos
from fthsdp.chaos.schedule import Fault
from lighthouse import lane_hosts
from lighthouse.model import ACTIVE, Endpoints, EpochMember

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 120
IDS = [f"replica-{i}" for i in range(3)]


def _host(ids: list[str], lane: int) -> str:
    host = lane_hosts.host([EpochMember(rid, "i", ACTIVE, 2, Endpoints()) for rid in ids], lane)
    assert host is not None
    return host


def _rebuilds(log: pathlib.Path) -> dict[tuple[int, int], str]:
    """(epoch, lane) -> where that replica's lane met, from its log."""
    out: dict[tuple[int, int], str] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "data plane rebuilt" not in line:
            continue
        epoch = re.search(r"epoch=(\d+)", line)
        lane = re.search(r"lane=(\d+)", line)
        where = line.rsplit(" on ", 1)
        assert epoch and lane and len(where) == 2, line
        out[(int(epoch[1]), int(lane[1]))] = where[1].strip()
    return out


@pytest.mark.parametrize("spread_from", [0, 2], ids=["one-store", "spread"])
def test_killing_a_lanes_host_moves_its_lanes_to_the_next_host_and_only_it_pays(tmp_path: pathlib.Path,
                                                                                spread_from: int) -> None:
    """``spread``: lanes of 2 members or more meet on their kept candidates' stores at once (``SpreadStore``), so
    after the kill each survivor's lanes meet on both survivors' stores, each arriving on its own."""
    host = _host(IDS, 0)
    victim = IDS.index(host)
    cfg = ChaosConfig(seed=0, replicas=3, steps=STEPS, ranks=2, min_step_s=0.1, heartbeat_timeout_s=3.0,
                      collective_timeout_s=4.0, epoch_wait_s=10.0, timeout_s=360, log_level="INFO",
                      lane_spread_from=spread_from)
    result = run_chaos(cfg, tmp_path, faults=[Fault("kill", 10, (victim,), ("forward",))])
    assert result["violations"] == [], result["violations"]
    finals = result["finals"]
    assert len(finals) == 3 and all(f is not None and f["step"] == STEPS for f in finals.values()), finals
    assert len({f["param_hash"] for f in finals.values()}) == 1, finals
    assert {e["replica"] for e in result["exits"]} == {victim}, result["exits"]
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    survivors = [rid for rid in IDS if rid != host]
    # The epoch the kill formed, as the lighthouse's status showed it: the survivors alone.
    formed = sorted({e["epoch"] for e in report["events"] if e["event"] == "epoch_seen"
                     and sorted(e.get("members") or []) == survivors})
    assert formed, [e for e in report["events"] if e["event"] == "epoch_seen"][:5]
    for rid in survivors:
        met = _rebuilds(tmp_path / f"replica{IDS.index(rid)}.log")
        for lane in (0, 1):
            # The first epoch met on the hosts' stores (their addresses announced on the lighthouse)...
            assert met.get((1, lane)) == f"{_host(IDS, lane)}'s lane store", (rid, lane, met)
            # ... and after the kill, every lane of every survivor met on the store of the host the rule names for
            # the survivors, whose address it kept: the dead host's lanes moved, the others stayed.
            later = sorted((epoch, where) for (epoch, ln), where in met.items() if ln == lane and epoch > 1)
            spread = " and 1 more" if spread_from else ""
            assert later and later[0] == (formed[0], f"{_host(survivors, lane)}'s lane store{spread}"), \
                (rid, lane, later)
