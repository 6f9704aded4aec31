"""A warm standby (``FTHSDP_STANDBY_GATE``; docs/design.md §7, "Warm restarts"): a replica process a launcher
starts ahead of need. It runs the trainer's own set-up unregistered (``Replica()``, ``shard``, ``optimizer``: no
lighthouse call), and at its first ``train_step`` warms up and waits for its gate file. Once the launcher creates
the file (to replace a failed incarnation of the group) it registers and goes on, in that same call, as the role
the lighthouse gives it: a joiner catches up, an active replica resumes from the newest checkpoint, a replica back
after the job finished raises ``JobFinished``. So a restart costs the registration and the catch-up only."""

from __future__ import annotations

import logging

from fthsdp.runtime.core import StepCore
from fthsdp.runtime.startup import Role, hold_as_standby


def release(core: StepCore) -> Role:
    """Wait for the gate, then register (``StepCore.register``): returns the role the lighthouse gives."""
    core.log(logging.INFO, "warm standby: waiting for %s", core.config.standby_gate)
    held = hold_as_standby(core.config.standby_gate)
    core.log(logging.INFO, "released after %.1fs as a warm standby; registering", held)
    return core.register()
