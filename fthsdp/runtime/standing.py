"""What a replica's state is, as its step core (``fthsdp.runtime.core``) needs to know it: each role
(``fthsdp.runtime.roles``) has one."""

from __future__ import annotations

import enum


class Standing(enum.Enum):
    """What a replica's state is, as its step core needs to know it (each role has one: ``roles.Role.standing``)."""

    STANDBY = "standby"
    """Not registered yet (a warm standby): it holds the state as the trainer built it."""
    JOINING = "joining"
    """Registered, not holding the others' state yet: its exchanges are zeros, its replays commit as a joiner's."""
    MEMBER = "member"
    """It holds the job's state: it serves snapshots and ends the job with the others (the end-of-job barrier)."""
    FINISHED = "finished"
    """Back after the job finished: it holds the final checkpoint and trains nothing."""
