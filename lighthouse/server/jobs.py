"""One job's live state on the lighthouse, and the lighthouse's clock.

All job state is touched only on the server's event loop, so nothing here needs a lock except around the
(possibly slow) store write. Heartbeats take a fast path: they only stamp ``last_seen``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import Iterable

from lighthouse import deltas
from lighthouse.liveness import Deadlines
from lighthouse.model import Epoch, State
from lighthouse.proto_codec import delta_to_pb, epoch_to_pb
from lighthouse.slots import OrphanSteps, waiting_slots
from lighthouse.stragglers import PACE_WINDOW, Pace
from lighthouse.v1 import lighthouse_pb2 as pb

_CLOCK_OFFSET = time.time() - time.monotonic()
COMPRESS_ABOVE = 16 * 1024
"""A full epoch bigger than this (serialized) goes out compressed on sessions (``SessionUpdate.epoch_zlib``): once
per epoch on the lighthouse, a third of the bytes to every session (thousands, at a bootstrap)."""
DELTA_HISTORY = 64
"""Consecutive epoch deltas a job keeps: a session that fell up to this many epochs behind gets one composed delta;
further behind (or new), the full epoch."""


def clock() -> float:
    """Seconds since the Unix epoch, advancing monotonically (wall-clock jumps do not kill anyone)."""
    return time.monotonic() + _CLOCK_OFFSET


class Waker:
    """Wakes one session's pusher (``Lighthouse.Session``): at a new epoch (``Job.wake``), at its reader's end, or
    for a resync. One future per wait and one call per wake: cheaper than ``asyncio.wait`` on three awaitables,
    which a lighthouse with 10,000 sessions pays 10,000 times per epoch change."""

    __slots__ = ("_future", "_kicked")

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self._kicked = False

    def kick(self) -> None:
        self._kicked = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        """Return at the next ``kick``, or at once if one came since the last wait."""
        if not self._kicked:
            self._future = asyncio.get_running_loop().create_future()
            try:
                await self._future
            finally:
                self._future = None
        self._kicked = False


class Job:
    """One job's state on the server: the membership state, liveness (volatile: never stored) and the current
    epoch as pushed to watchers."""

    def __init__(self, job_id: str, state: State, rendezvous: str, seen_at: float, timeout_s: float = 3.0,
                 spread_from: int = 0) -> None:
        self.job_id = job_id
        self.rendezvous = rendezvous
        self.spread_from = spread_from
        """Stamped on every epoch pushed (``Epoch.lane_spread_from``; 0: not said)."""
        self.write_lock = asyncio.Lock()
        self.changed = asyncio.Event()
        """Set (and replaced by a fresh one) whenever a new epoch is published or the server stops. An Event wakes
        every watcher in one go; a Condition would hand its lock from watcher to watcher, one loop iteration
        each, which delays the last of a thousand watchers by the whole chain."""
        self.sessions: set[Waker] = set()
        """The open sessions' wakers: every one is kicked at each ``wake``."""
        self._chain: deque[deltas.Delta] = deque(maxlen=DELTA_HISTORY)
        """The deltas between the last published epochs, oldest first (the newest ends at the current epoch)."""
        self._updates: dict[int, bytes] = {}
        """For the current epoch: the epoch a session holds -> the SessionUpdate that brings it here."""
        self._timeout_s = timeout_s  # the heartbeat timeout (``Policy.heartbeat_timeout_s``) of the deadlines
        self._disconnected: dict[str, tuple[str, float]] = {}
        """replica id -> (incarnation, when a watch stream of it closed from its end without being replaced)."""
        self.restore(state, seen_at)

    def restore(self, state: State, seen_at: float) -> None:
        """Take ``state`` (loaded from the store): its members count as last seen at ``seen_at``."""
        self.state = state
        self.last_seen: dict[str, float] = {rid: seen_at for rid in state.members}
        self.deadlines = Deadlines(self._timeout_s)
        """Heartbeat deadlines of the members (``lighthouse.liveness``): what a liveness tick looks at."""
        self.deadlines.add(state.members, self.last_seen)
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
        self.orphan_steps = OrphanSteps()
        """Per data slot, the steps it had no active holder in (``/status``'s ``orphan_steps``; soft state)."""
        # No epoch before it: the chain starts over (what sessions hold may be another lighthouse's epochs).
        self._epoch: Epoch | None = None
        self.set_epoch(state.epoch)

    def set_epoch(self, epoch: Epoch | None) -> None:
        """Take the current epoch, and the delta from the epoch published before it. The full epoch is encoded
        only when something asks for it (``epoch_pb``), once: a change that every session takes as a delta
        costs O(changed), not O(members)."""
        before, self._epoch = self._epoch, epoch
        self.orphan_steps.observe(waiting_slots(self.state), self.step)
        self._epoch_pb: pb.Epoch | None = None
        self._epoch_bytes: bytes | None = None
        self._updates = {}
        if epoch is None or before is None or epoch.number <= before.number:
            self._chain.clear()
        elif before is not epoch:
            self._chain.append(deltas.diff(before.number, before.members, epoch.number, epoch.members))

    @property
    def step(self) -> int:
        """The job's step as the lighthouse knows it: the highest its members' heartbeats reported."""
        return max(self.steps.values(), default=0)

    @property
    def epoch_pb(self) -> pb.Epoch:
        """The current epoch as the wire has it (number 0 before the first)."""
        if self._epoch_pb is None:
            self._epoch_pb = epoch_to_pb(self.job_id, self._epoch, self.rendezvous, self.spread_from)
        return self._epoch_pb

    @property
    def epoch_bytes(self) -> bytes:
        """``epoch_pb`` serialized, once, for every watcher."""
        if self._epoch_bytes is None:
            self._epoch_bytes = self.epoch_pb.SerializeToString()
        return self._epoch_bytes

    def update_for(self, held: int) -> bytes:
        """The ``SessionUpdate`` (serialized) that brings a session holding epoch ``held`` (0: none) to the current
        one: a delta when the chain reaches back to ``held``, else the full epoch. Built once per epoch held."""
        raw = self._updates.get(held)
        if raw is not None:  # every session holding the same epoch: one dict lookup
            return raw
        chain = list(self._chain)  # consecutive, ending at the current epoch (set_epoch keeps it so)
        start = next((i for i, d in enumerate(chain) if d.base == held), None) if held else None
        if start is None:
            return self._full_update()
        assert self._epoch is not None
        delta = delta_to_pb(self.job_id, self._epoch, self.rendezvous, deltas.compose(chain[start:]),
                            self.spread_from)
        raw = self._updates[held] = pb.SessionUpdate(delta=delta).SerializeToString()
        return raw

    def _full_update(self) -> bytes:
        """The current epoch whole, compressed when big; cached under 0 (whatever the session held: no unbounded
        cache of odd numbers)."""
        raw = self._updates.get(0)
        if raw is None:
            whole = self.epoch_bytes
            full = (pb.SessionUpdate(epoch_zlib=zlib.compress(whole, 1)) if len(whole) > COMPRESS_ABOVE
                    else pb.SessionUpdate(epoch=self.epoch_pb))
            raw = self._updates[0] = full.SerializeToString()
        return raw

    @property
    def number(self) -> int:
        return self.state.epoch.number if self.state.epoch is not None else 0

    def wake(self) -> None:
        """Wake every watcher and session."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
        for waker in self.sessions:
            waker.kick()

    def joined(self, replica_ids: Iterable[str], now: float) -> None:
        """New members: seen now, and watched for their heartbeat timeout."""
        ids = [rid for rid in replica_ids if rid not in self.last_seen]
        for rid in ids:
            self.last_seen[rid] = now
        self.deadlines.add(ids, self.last_seen)

    def stream_opened(self, replica_id: str, incarnation: str) -> None:
        """A session or watch stream of ``incarnation`` opened here: it replaces one that closed, if any."""
        if self._disconnected.get(replica_id, ("", 0.0))[0] == incarnation:
            del self._disconnected[replica_id]

    def stream_closed(self, replica_id: str, incarnation: str, closed_by_peer_at: float | None) -> None:
        """A session or watch stream of ``incarnation`` ended; ``closed_by_peer_at`` when the replica's end closed it
        (its process died, or its connection broke), ``None`` when this server ended it (no evidence)."""
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
