"""One job's live state on the lighthouse, and the lighthouse's clock.

All job state is touched only on the server's event loop, so nothing here needs a lock except around the
(possibly slow) store write. Heartbeats take a fast path: they only stamp ``last_seen``.
"""

from __future__ import annotations

import asyncio
import time

from lighthouse.model import Epoch, State
from lighthouse.proto_codec import epoch_to_pb
from lighthouse.stragglers import PACE_WINDOW, Pace

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
        self._disconnected: dict[str, tuple[str, float]] = {}
        """replica id -> (incarnation, when a watch stream of it closed from its end without being replaced)."""
        self.restore(state, seen_at)

    def restore(self, state: State, seen_at: float) -> None:
        """Take ``state`` (loaded from the store): its members count as last seen at ``seen_at``."""
        self.state = state
        self.last_seen: dict[str, float] = {rid: seen_at for rid in state.members}
        self.steps: dict[str, int] = {}
        """replica id -> the step it reported with its last heartbeat (informational)."""
        self.digests: dict[str, tuple[str, int, str]] = {}
        """replica id -> (incarnation, step, state digest) of the latest digest its heartbeats carried
        (informational; an older incarnation's is not shown)."""
        self.paces: dict[str, tuple[str, tuple[Pace, ...]]] = {}
        """replica id -> (incarnation, its last pace reports of distinct steps): fail-slow evidence
        (``lighthouse.stragglers``; an older incarnation's is not counted)."""
        self.ejected: set[str] = set()
        """Replicas ejected as slow (``lighthouse.ejection``): the next incarnation enters the data plane once a
        probe step shows it healthy (soft state: a restarted lighthouse admits it)."""
        self.last_eject_step = -PACE_WINDOW
        self.stragglers_checked = 0.0
        """The step the last ejection was decided at (the next needs reports from after it); when the ``eject``
        policy last looked (``clock()``)."""
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

    def stream_opened(self, replica_id: str, incarnation: str) -> None:
        """A watch stream of ``incarnation`` opened here: it replaces one that closed, if any."""
        if self._disconnected.get(replica_id, ("", 0.0))[0] == incarnation:
            del self._disconnected[replica_id]

    def stream_closed(self, replica_id: str, incarnation: str, closed_by_peer_at: float | None) -> None:
        """A watch stream of ``incarnation`` ended; ``closed_by_peer_at`` when the replica's end closed it (its
        process died, or its connection broke), ``None`` when this server ended it (no evidence)."""
        if closed_by_peer_at is not None:
            self._disconnected[replica_id] = (incarnation, closed_by_peer_at)
            if len(self._disconnected) > 2 * len(self.state.members) + 64:  # ids that are no members: forget them
                self._disconnected = {r: v for r, v in self._disconnected.items() if r in self.state.members}

    def disconnected_s(self, replica_id: str, now: float) -> float | None:
        """Seconds since a watch stream of the member's current incarnation closed from its end without being
        replaced (``None``: not a member, or no such evidence)."""
        member = self.state.members.get(replica_id)
        seen = self._disconnected.get(replica_id)
        if member is None or seen is None or seen[0] != member.incarnation:
            return None
        return max(0.0, now - seen[1])
