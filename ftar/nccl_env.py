"""c10d's NCCL watchdog settings that keep survivors alive (docs/gpu.md §4 "The watchdog").

c10d reads its error handling from the environment when it builds each NCCL process group. By default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset: 3, SkipCleanUp) a group's watchdog takes the whole process down soon after
NCCL reports an error, such as a peer's death, and with ``TORCH_NCCL_DUMP_ON_TIMEOUT`` every group's heartbeat
monitor ends the process once any group asked for a debug dump. For a cross-replica lane either is fatal: a survivor
must outlive a dead peer, so FTAR's watcher, not c10d's, decides (it aborts, blames and redoes).

Two layers:

- ``PROCESS``, set in each rank's environment before any process group exists (``prepare_process``: the runtime
  calls it before ``init_process_group``, and ``fthsdp run`` puts it in every rank's environment):
  no dump-and-die on a timeout, torchft's nonblocking-init timeout set up front, and the keys the lane layer
  changes present with the trainer's values.
- ``LANE``, in force only while FTAR constructs a lane's group (``lane_settings``, under a lock): no asynchronous
  error handling (the watchdog records the error, FTAR reads it and aborts) and no blocking ``wait()``.

The trainer's own groups (init_process_group's, FSDP2's, a device mesh's) keep c10d's error handling: an NCCL error
inside a replica still ends the process, and torchrun restarts the replica as a unit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, MutableMapping

log = logging.getLogger("fthsdp.ftar")

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"

C10D_DEFAULTS = {ASYNC_ERROR_HANDLING: "3", BLOCKING_WAIT: "0"}
"""c10d's values when a key is unset (3: SkipCleanUp, tear the process down on an error; wait() does not block)."""

PROCESS = {DUMP_ON_TIMEOUT: "0", NONBLOCKING_TIMEOUT: "10"}
"""Set before any group exists, unless the environment already says otherwise (then a warning). The nonblocking
timeout is FTAR's connect timeout (torchft would otherwise set it from its first group, after groups exist)."""

LANE = {ASYNC_ERROR_HANDLING: "0", BLOCKING_WAIT: "0"}
"""In force while a lane's group is built: the watchdog records an error and does nothing else."""

_lock = threading.Lock()


def process_settings(environ: MutableMapping[str, str]) -> dict[str, str]:
    """What ``prepare_process`` adds to ``environ`` (pure: nothing is changed): ``PROCESS`` where unset, and the keys
    ``LANE`` changes, at c10d's defaults, where unset."""
    wanted = {**PROCESS, **{k: C10D_DEFAULTS[k] for k in LANE}}
    return {k: v for k, v in wanted.items() if k not in environ}


def conflicts(environ: MutableMapping[str, str]) -> list[str]:
    """Settings in ``environ`` that put survivors at risk (a warning each): a dump on timeout ends the process."""
    value = environ.get(DUMP_ON_TIMEOUT, PROCESS[DUMP_ON_TIMEOUT])
    if value == PROCESS[DUMP_ON_TIMEOUT]:
        return []
    return [f"{DUMP_ON_TIMEOUT}={value} (fthsdp wants {PROCESS[DUMP_ON_TIMEOUT]}: a peer's failure could end this "
            "survivor)"]


def prepare_process(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``process_settings`` into ``environ`` (this process's by default) and warn about ``conflicts``; call it
    before any process group exists. Returns what it set."""
    env = os.environ if environ is None else environ
    added = process_settings(env)
    env.update(added)
    for c in conflicts(env):
        log.warning("nccl settings: %s", c)
    return added


@contextlib.contextmanager
def lane_settings(environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """``LANE`` in force in ``environ`` for the duration (one lane at a time), the previous values back after. The
    keys already exist (``prepare_process``), so the change replaces values in place, never grows the environment
    under another thread's ``getenv``."""
    env = os.environ if environ is None else environ
    with _lock:
        before = {k: env.get(k) for k in LANE}
        env.update(LANE)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
