"""Loopback ports for the processes tests and benchmarks start: a free one to bind, and a wait (with a deadline)
until something listens on one."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A loopback port free right now (another binder may take it before ours does: callers retry or accept it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until something accepts connections on ``127.0.0.1:port``; raise if ``proc`` exits first or at the
    deadline."""
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
