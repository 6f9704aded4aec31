"""The simulated lighthouse: the real membership decision (``lighthouse.membership.decide``), the real incarnation
check, the real state document and in-memory store, fed by simulated calls and ticks, as ``lighthouse.server.edge``
feeds them on the real server (decide, persist a changed epoch counter through the store's fence, publish)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fthsdp.chaos.sim.world import World
from lighthouse import membership as m
from lighthouse.errors import EpochFenced
from lighthouse.incarnations import check_incarnation
from lighthouse.model import FINISHED, Endpoints
from lighthouse.state_doc import durable_change, state_from_doc, state_to_doc
from lighthouse.stores.memory import InMemoryStore

JOB = "default"
TICK_S = 0.05
"""The liveness tick (the server's)."""


@dataclass(frozen=True)
class Published:
    """An epoch as the lighthouse published it, with the lighthouse's life it came from."""

    t: float
    number: int
    members: tuple[tuple[str, str, str], ...]
    """(replica id, incarnation, role)."""
    life: int
    finished: bool = False
    """Formed after a member left the job finished (the min-replicas guard no longer applies)."""


class SimLighthouse:
    """One lighthouse over a store; ``restart`` ends its life and starts another on the same store (durable) or a
    new one (in-memory)."""

    def __init__(self, world: World, policy: m.Policy, publish: Callable[[m.Epoch], None],
                 strip_counter: bool = False) -> None:
        self.world, self.policy, self._publish = world, policy, publish
        self.strip_counter = strip_counter
        """Variant ``reuse-epochs``: a store that keeps no epoch counter (loads without it)."""
        self.store = InMemoryStore()
        self.life = 0
        self.up = True
        self.published: list[Published] = []
        self.departed: dict[tuple[str, str], tuple[float, int]] = {}
        """Every (replica, incarnation) any life of it dropped: when it first did, and in which life."""
        self.store_down_until = -1.0
        """The store has no leader until then (``store-leader`` fault): every write is refused as unavailable."""
        self.lives: list[bool] = [True]
        """Per life, whether it began with the previous life's store (the first: True)."""
        self._load()
        world.after(TICK_S, self._tick)

    def _load(self) -> None:
        doc = self.store.load(JOB)
        if doc is not None and self.strip_counter:
            doc = {**doc, "last_number": 0, "epoch": None, "history": []}
            self.store = InMemoryStore()
        self.state = state_from_doc(doc, self.world.now)
        self.last_seen = {rid: self.world.now for rid in self.state.members}
        self.steps: dict[str, int] = {}
        self.closed: dict[str, tuple[str, float]] = {}

    def restart(self, down_s: float, durable: bool) -> None:
        """Crash now; back after ``down_s`` on the same store (``durable``) or an empty one."""
        self.up = False
        self.life += 1
        self.lives.append(durable)
        life = self.life

        def back() -> None:
            if self.life != life:
                return
            if not durable:
                self.store = InMemoryStore()
            self._load()
            self.up = True
            self.world.log(f"lighthouse back (life {life}, {'durable' if durable else 'in-memory'} store): "
                           f"epoch {self.number}")
        self.world.after(down_s, back)

    @property
    def number(self) -> int:
        return self.state.epoch.number if self.state.epoch is not None else 0

    # --- the edge ---------------------------------------------------------------------------------------------

    def apply(self, event: m.Event) -> m.Outcome:
        before = self.state
        out = m.decide(before, event, self.policy)
        if out.rejection is not None or out.state is before:
            return out
        new_epoch = out.new_epoch(before)
        if durable_change(before, out.state):
            if self.world.now < self.store_down_until:  # as ``Edge.apply`` on ``StoreUnavailable``
                return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", "store unavailable: no leader"))
            try:
                self.store.save(JOB, before.last_number, state_to_doc(out.state))
            except EpochFenced as e:
                return m.Outcome(before, rejection=m.Rejection("UNAVAILABLE", f"store write fenced: {e}"))
        self.state = out.state
        for rid in out.state.members.keys() - before.members.keys():
            self.last_seen.setdefault(rid, self.world.now)
        for rid in sorted(before.members.keys() - out.state.members.keys()):
            self.last_seen.pop(rid, None)
            self.steps.pop(rid, None)
            self.departed.setdefault((rid, before.members[rid].incarnation), (self.world.now, self.life))
        if out.events:
            self.world.log(f"lighthouse: {out.reason}")
        if new_epoch is not None:
            self.published.append(Published(self.world.now, new_epoch.number,
                                            tuple((x.replica_id, x.incarnation, x.role) for x in new_epoch.members),
                                            self.life, out.state.finished_step is not None))
            self.world.log(f"lighthouse: epoch {new_epoch.number} "
                           + ",".join(f"{x.replica_id}/{x.incarnation}:{x.role}" for x in new_epoch.members))
            self._publish(new_epoch)
        return out

    def _tick(self) -> None:
        if self.up:
            self.apply(m.Tick(now=self.world.now, last_seen=dict(self.last_seen)))
        self.world.after(TICK_S, self._tick)

    # --- calls (each answers a Rejection or what the real service answers) ------------------------------------

    def register(self, rid: str, inc: str, claim: str, last_epoch: int, slot: int = m.NO_SLOT,
                 slots: int = 0) -> m.Rejection | dict[str, Any]:
        out = self.apply(m.Register(rid, inc, 1, Endpoints(), self.world.now, claim=claim, last_epoch=last_epoch,
                                    slot=slot, slots=slots))
        if out.rejection is not None:
            return out.rejection
        if out.finished_step is not None:
            return {"finished": out.finished_step, "epoch": self.state.epoch}
        self.last_seen[rid] = self.world.now
        return {"role": self.state.members[rid].role, "epoch": self.state.epoch}

    def heartbeat(self, rid: str, inc: str, step: int) -> m.Rejection | dict[str, Any]:
        if (rej := check_incarnation(self.state, rid, inc)) is not None:
            return rej
        self.last_seen[rid] = self.world.now
        self.steps[rid] = step
        return {"epoch": self.number}

    def ready(self, rid: str, inc: str, role: str) -> m.Rejection | dict[str, Any]:
        out = self.apply(m.Ready(rid, inc, role, self.world.now))
        return out.rejection if out.rejection is not None else {}

    def report(self, rid: str, inc: str, suspect: str, epoch: int, early: bool) -> m.Rejection | dict[str, Any]:
        closed = self.closed.get(suspect)
        member = self.state.members.get(suspect)
        gone = (max(0.0, self.world.now - closed[1]) if closed is not None and member is not None
                and closed[0] == member.incarnation else None)
        out = self.apply(m.Report(rid, inc, suspect, epoch, "collective failed", self.world.now,
                                  dict(self.last_seen), disconnected_s=gone, early=early,
                                  suspect_step=self.steps.get(suspect)))
        return out.rejection if out.rejection is not None else {}

    def leave(self, rid: str, inc: str, step: int) -> m.Rejection | dict[str, Any]:
        out = self.apply(m.Leave(rid, inc, FINISHED, self.world.now, step=step))
        return out.rejection if out.rejection is not None else {}

    def stream_closed(self, rid: str, inc: str) -> None:
        """The replica's process died: the kernel closed its watch stream (evidence of death)."""
        if self.up:
            self.closed[rid] = (inc, self.world.now)

    def current(self) -> m.Epoch | None:
        return self.state.epoch

