"""Small helpers for starting and waiting on our own child processes (every wait has a deadline)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a trainer child: this process's, one thread per process (the cores are shared),
    unbuffered output, ``extra``; never a stray ``FTHSDP_FAULT`` from the caller's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("FTHSDP_FAULT", None)
    return env


def torchrun(nproc: int, *, max_restarts: int = 0) -> list[str]:
    """The command line of a standalone torchrun of ``nproc`` workers (the module and its flags follow)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts)]


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


def kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL our own child's process group (started with ``start_new_session``) and reap it."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_to_completion(cmd: list[str], env: dict[str, str], log_path: pathlib.Path, timeout_s: float,
                      what: str) -> None:
    """Run ``cmd`` in its own session, output appended to ``log_path``, until it exits (its process group is
    killed at the end either way); raise if it fails or outlasts ``timeout_s``."""
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what} did not finish in {timeout_s}s (log: {log_path})") from None
    finally:
        kill_group(proc)
    if code != 0:
        raise RuntimeError(f"{what} exited with {code} (log: {log_path})")
