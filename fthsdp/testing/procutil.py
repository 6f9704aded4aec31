"""Small helpers for starting and waiting on our own child processes (every wait has a deadline)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time


class ProcessDied(RuntimeError):
    """A child process exited while we were waiting for it to become ready."""


def wait_for_file(path: pathlib.Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    """Wait until ``path`` exists with a complete last line; return its text. Raises on deadline or if
    ``proc`` exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            text = path.read_text()
            if text.endswith("\n"):
                return text.strip()
        if proc is not None and proc.poll() is not None:
            raise ProcessDied(f"process {proc.pid} exited with {proc.returncode} before writing {path}")
        time.sleep(0.02)  # polling a condition with a deadline
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Write ``text`` (newline-terminated) so readers never see half of it."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM our own child, then SIGKILL at the deadline; return its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
