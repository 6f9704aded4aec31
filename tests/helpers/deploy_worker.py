"""A stand-in trainer for tests/integration/test_deploy.py's run of deploy/torchrun/single_host.sh: no torch, no
training; it records what it saw and exits the way DEPLOY_TEST_PLAN says for its replica index and run number.

DEPLOY_TEST_PLAN: ``index=code,code,...;...`` — the exit status of this group's 1st, 2nd... run (counted across
torchrun's in-place restarts and the script's restarts); past the list: 0. ``fatal`` instead of a code: write
a fatal event (as the example trainer does for an unrecoverable error) and exit 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> None:
    progress = os.environ["FTHSDP_PROGRESS"]
    index = int(os.environ["FTHSDP_REPLICA_INDEX"])
    plan = dict(item.split("=", 1) for item in os.environ.get("DEPLOY_TEST_PLAN", "").split(";") if item)
    codes = plan.get(str(index), "").split(",") if str(index) in plan else []
    try:
        with open(progress) as f:
            runs = sum(1 for line in f if '"event": "run"' in line)
    except FileNotFoundError:
        runs = 0
    host, port = os.environ["FTHSDP_LIGHTHOUSE"].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        reachable = True
    except OSError:
        reachable = False
    row = {"event": "run", "run": runs + 1, "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
           "share_store_disabled": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
           "num_replicas": os.environ.get("FTHSDP_NUM_REPLICAS"), "lighthouse_reachable": reachable,
           "args": sys.argv[1:], "t": time.time()}
    code = codes[runs] if runs < len(codes) else "0"
    with open(progress, "a") as f:
        f.write(json.dumps(row) + "\n")
        if code == "fatal":
            f.write(json.dumps({"event": "fatal", "error": "planned fatal error", "t": time.time()}) + "\n")
    sys.exit(1 if code == "fatal" else int(code))


if __name__ == "__main__":
    main()
