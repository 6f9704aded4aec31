"""The fault actions of a chaos run that signal processes: killing a lighthouse. Stopping, continuing or killing a
whole replica group (a torchrun agent and its workers, which torchrun starts in sessions of their own) is
``fthsdp.launch.procutil.signal_tree``, which the launcher's teardown uses too."""

from __future__ import annotations

import signal
import subprocess


def kill_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL our own child (a lighthouse) and reap it."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
