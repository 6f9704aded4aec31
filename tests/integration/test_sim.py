"""``fthsdp sim`` as a command (a subprocess): JSON with the paper's figures, and bad input refused. The model itself
is tested in ``tests/unit/test_sim.py``."""

from __future__ import annotations

import json
import subprocess
import sys


def test_cli_prints_json_with_ett() -> None:
    out = subprocess.run([sys.executable, "-m", "fthsdp", "sim", "--gpus", "98304", "--replica-gpus", "8192",
                          "--mtbf-min", "18", "--sync-recovery-min", "10", "--stall-min", "3", "--rejoin-min", "10",
                          "--json"], check=True, capture_output=True, text=True, timeout=60).stdout
    r = json.loads(out)
    assert round(r["sync"]["ett"], 2) == 0.44 and round(r["fthsdp"]["ett"], 2) == 0.80
    bad = subprocess.run([sys.executable, "-m", "fthsdp", "sim", "--gpus", "100", "--replica-gpus", "7",
                          "--mtbf-min", "18", "--sync-recovery-min", "10", "--stall-min", "3", "--rejoin-min", "10"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "multiple" in bad.stderr
