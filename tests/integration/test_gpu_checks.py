"""The one-GPU check's peer-kill part (deploy/gpu/peer_kill_check.py) on the CPU: its plumbing (three processes, the
victim SIGKILLed mid-collective, the survivor's detection, its life afterwards and the rebuild with a rejoiner)
runs over Gloo here, and its verdict fails every way a survivor can fail. On a GPU it runs over NCCL
(deploy/gpu/nccl_check.sh, one-GPU mode)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "gpu" / "peer_kill_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peer_kill_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_survivor_lives_through_its_peers_sigkill_and_rebuilds_over_gloo() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--settings", "fixed", "--backend", "gloo", "--live", "5"],
                         env=env, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["ok"] and r["survived"] and r["rebuilt"] and r["warm"], r
    assert r["failure_found"] == "failed" and r["statuses"]["victim"] == -9  # found from the error, not a deadline


GOOD: list[dict[str, Any]] = [
    {"event": "start"}, {"event": "warm", "value": 3.0}, {"event": "peer_failed", "outcome": "failed", "s": 0.5},
    {"event": "alive", "s": 5}, {"event": "rebuilt", "value": 3.0}, {"event": "end"}]
STATUSES = {"victim": -9, "rejoiner": 0, "survivor": 0}


@pytest.mark.parametrize("case", ["died", "torn-down-later", "no-rebuild", "wrong-value", "victim-lived", "good"])
def test_the_verdict_fails_every_way_a_survivor_can_fail(case: str) -> None:
    verdict = _module().verdict
    events, statuses = [dict(e) for e in GOOD], dict(STATUSES)
    if case == "died":  # c10d's watchdog took it down (SIGABRT)
        events, statuses["survivor"] = events[:3], -6
    elif case == "torn-down-later":
        events, statuses["survivor"] = events[:4], -6
    elif case == "no-rebuild":
        statuses["rejoiner"] = 1
    elif case == "wrong-value":
        events[4]["value"] = 2.0
    elif case == "victim-lived":  # the kill never happened: nothing was checked
        statuses["victim"] = 0
    r = verdict("fixed", 5.0, statuses, events)
    assert r["ok"] is (case == "good"), r
