"""One job's live state on the lighthouse, and the lighthouse's clock.

All job state is touched only on the server's event loop, so nothing here needs a lock except around the
(possibly slow) store write. Heartbeats take a fast path: they only stamp ``last_seen``.
"""

from __future__ import annotations

import asyncio
import time

from lighthouse.model import Epoch, State
from lighthouse.proto_codec import epoch_to_pb

_CLOCK_OFFSET = time.time() - time.monotonic()


def clock() -> float:
    """Seconds since the Unix epoch, advancing monotonically (wall-clock jumps do not kill anyone)."""
    return time.monotonic() + _CLOCK_OFFSET


class Job:
    """One job's state on the server: the membership state, liveness (volatile: never stored) and the current
    epoch as pushed to watchers."""

    def __init__(self, job_id: str, state: State, rendezvous: str, seen_at: float) -> None:
        self.job_id = job_id
        self.rendezvous = rendezvous
        self.write_lock = asyncio.Lock()
        self.changed = asyncio.Event()
        """Set (and replaced by a fresh one) whenever a new epoch is published or the server stops. An Event wakes
        every watcher in one go; a Condition would hand its lock from watcher to watcher, one loop iteration
        each, which delays the last of a thousand watchers by the whole chain."""
        self.restore(state, seen_at)

    def restore(self, state: State, seen_at: float) -> None:
        """Take ``state`` (loaded from the store): its members count as last seen at ``seen_at``."""
        self.state = state
        self.last_seen: dict[str, float] = {rid: seen_at for rid in state.members}
        self.steps: dict[str, int] = {}
        """replica id -> the step it reported with its last heartbeat (informational)."""
        self.set_epoch(state.epoch)

    def set_epoch(self, epoch: Epoch | None) -> None:
        """Encode the current epoch once, for every watcher."""
        self.epoch_pb = epoch_to_pb(self.job_id, epoch, self.rendezvous)
        self.epoch_bytes = self.epoch_pb.SerializeToString()

    @property
    def number(self) -> int:
        return self.state.epoch.number if self.state.epoch is not None else 0

    def wake(self) -> None:
        """Wake every watcher."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
