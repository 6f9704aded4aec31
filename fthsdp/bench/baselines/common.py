"""Helpers the baseline runs share: ports, progress files, child processes (every wait has a deadline)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

WARMUP_STEPS = 5
"""Steps excluded from the steady-state medians (WORKLOAD.md)."""


def free_port() -> int:
    """A loopback port free right now (a race with other binders is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)  # polling a condition with a deadline
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def read_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.endswith("}")]


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("FTHSDP_FAULT", None)
    return env


def torchrun(nproc: int, *, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts)]


def kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL our own child's process group (started with ``start_new_session``) and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
