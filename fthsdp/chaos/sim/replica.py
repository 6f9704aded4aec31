"""One incarnation of a simulated replica group, as the lighthouse sees it: it registers, heartbeats, re-registers
with the role it holds when the lighthouse lost it (``lighthouse.client_session``), asks to enter the data plane
and turns active after a catch-up, reports the peers its collectives miss, waits a bounded time for an epoch
that has it, and leaves when the job is done. Its exits are what invariant 7 counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fthsdp.chaos.sim.lighthouse import SimLighthouse
from fthsdp.chaos.sim.trainer import RETRY_S, SimTrainer
from fthsdp.chaos.sim.world import Net, World
from lighthouse import membership as m

RPC_TIMEOUT_S = 0.5
"""A call that gets no answer fails after this long."""
STEP_S = 0.2
"""A training step, while the replica trains (active in the epoch it knows, its data plane whole), without lanes
(with lanes: ``fthsdp.chaos.sim.trainer``)."""


class Host(Protocol):
    """What a replica's process reaches of the simulated cluster (``fthsdp.chaos.sim.cluster.SimCluster``)."""

    world: World
    net: Net
    lighthouse: SimLighthouse
    policy: m.Policy
    epoch_wait_s: float
    reuse_epochs: bool
    slots: int
    """The job's data slots (its replicas; the groups past them are spares)."""
    spares: int
    orphans: bool
    dropped_seen: dict[tuple[str, str], float]

    def exited(self, proc: SimReplica, why: str, finished: bool) -> None: ...

    def watch_opened(self, p: SimReplica) -> None: ...

    def data_plane(self, viewer: SimReplica, epoch: m.Epoch) -> None: ...

    def stalled(self, viewer: SimReplica, epoch: m.Epoch) -> bool: ...

    def new_trainer(self, proc: SimReplica) -> SimTrainer | None: ...

    def source_for(self, proc: SimReplica) -> SimTrainer | None: ...

    def resume(self) -> tuple[int, dict[int, tuple[tuple[int, int, tuple[int, ...]], ...]]] | None: ...


class SimReplica:
    """One incarnation (``index``, ``n``) of replica group ``r<index>``."""

    def __init__(self, cluster: Host, index: int, n: int) -> None:
        self.c, self.index, self.n = cluster, index, n
        self.rid, self.inc = f"r{index}", f"r{index}.{n}"
        self.alive = True
        self.hung_until = -1.0
        self.known: m.Epoch | None = None
        self.registered = False
        self.role = ""
        self.in_data_plane = False
        self.member_of = 0
        self.dropped_from = 0
        self.catching_up = False
        self.want_active = False
        self.excluded_at: float | None = None
        self.leaving = False
        self.step = 0
        """The step its heartbeats carry: it moves on only while it trains."""
        self.trainer = cluster.new_trainer(self)
        """With lanes: the data plane and the commit protocol (None: the step is a clock while it trains)."""

    # --- plumbing ---------------------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.c.world.now

    @property
    def world(self) -> World:
        return self.c.world

    def can_check_in(self) -> bool:
        """Whether it reaches the lighthouse, which hosts the data plane's store."""
        return not self.c.net.cut_from_lighthouse(self.rid)

    def source(self) -> SimTrainer | None:
        """A replica to catch up from."""
        return self.c.source_for(self)

    def hung(self) -> bool:
        return self.now < self.hung_until

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in this process: never once it ended; after the hang when it is stopped."""
        if not self.alive:
            return
        if self.hung():
            self.c.world.at(self.hung_until, lambda: self.run(fn))
            return
        fn()

    def call(self, name: str, args: tuple[Any, ...], ok: Callable[[dict[str, Any]], None],
             err: Callable[[m.Rejection], None]) -> None:
        """A call to the lighthouse over the simulated network: ``ok(answer)`` or ``err(Rejection)``."""
        c = self.c
        if c.net.cut_from_lighthouse(self.rid):
            c.world.after(RPC_TIMEOUT_S, lambda: self.run(lambda: err(m.Rejection("UNAVAILABLE", "unreachable"))))
            return
        answered = [False]

        def arrive() -> None:
            if not c.lighthouse.up:
                return
            answer = getattr(c.lighthouse, name)(self.rid, self.inc, *args)
            if answered[0]:
                return  # a duplicate: applied, its answer lost
            answered[0] = True
            back = c.net.latency(self.rid)
            if c.net.cut_from_lighthouse(self.rid):
                return
            c.world.after(back, lambda: self.run(lambda: (err if isinstance(answer, m.Rejection) else ok)(answer)))

        lat = c.net.latency(self.rid)
        for i in range(c.net.copies(self.rid)):
            c.world.after(lat * (1 + i), arrive)

        def timeout() -> None:
            if not answered[0]:
                answered[0] = True
                self.run(lambda: err(m.Rejection("UNAVAILABLE", "no answer")))
        c.world.after(RPC_TIMEOUT_S, timeout)

    def exit(self, why: str, finished: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if self.trainer is not None:
            self.trainer.close()
        self.c.world.log(f"{self.inc} exits: {why}")
        self.c.exited(self, why, finished)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self, cold_s: float) -> None:
        self.c.world.after(cold_s, lambda: self.run(lambda: self.register("", again=False)))

    def held_role(self) -> str:
        """As the real client's (``LighthouseRpc.held_role``)."""
        if self.role == m.ACTIVE or self.want_active:
            return m.ACTIVE
        return m.JOINING if self.in_data_plane else ""

    def member(self, epoch: m.Epoch | None) -> m.EpochMember | None:
        me = epoch.member(self.rid) if epoch is not None else None
        return me if me is not None and me.incarnation == self.inc else None

    def register(self, claim: str, again: bool) -> None:
        """Register (``again``: the lighthouse lost this incarnation; claim the role it holds, '' for none)."""
        first = not self.registered
        last = self.known.number if self.known is not None and not self.c.reuse_epochs else 0
        me = self.member(self.known)  # again: the slot it holds (``lighthouse.client_rpc``); first: its index's
        slot = me.slot if me is not None else self.index if self.index < self.c.slots else m.NO_SLOT

        def ok(a: dict[str, Any]) -> None:
            if "finished" in a:
                self.exit(f"the job finished at step {a['finished']}", finished=True)
                return
            self.role = a["role"]
            if again and a["role"] != (claim or m.JOINING):
                self.exit(f"lost: given back as {a['role']}, not {claim or m.JOINING}")
                return
            if first:
                self.registered = True
                self.c.watch_opened(self)
                if self.trainer is None:
                    self.c.world.after(STEP_S, lambda: self.run(self._train))
                self.c.world.after(self.c.policy.heartbeat_interval_s, lambda: self.run(self.heartbeat))
                if a["role"] == m.ACTIVE:  # its first step waits a bounded time for an epoch that has it
                    self.c.world.after(self.c.epoch_wait_s, lambda: self.run(self._first_epoch))
            self.on_epoch(a["epoch"])
            if a["role"] == m.JOINING and self.member(self.known) is None:
                self.ask_to_join()

        def err(r: m.Rejection) -> None:
            if r.code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT"):
                self.exit(f"registration refused: {r.message}")
            else:
                self.c.world.after(self.c.world.rng.uniform(0.2, 1.0),
                                   lambda: self.run(lambda: self.register(claim, again)))
        self.call("register", (claim, last, slot, self.c.slots if self.c.spares or self.c.orphans else 0), ok, err)

    def heartbeat(self) -> None:
        def ok(a: dict[str, Any]) -> None:
            if self.want_active and self.role != m.ACTIVE:
                self.ready(m.ACTIVE)

        def err(r: m.Rejection) -> None:
            if r.code == "FAILED_PRECONDITION":
                self.exit(f"incarnation over: {r.message}", finished="finished" in r.message)
            elif r.code == "NOT_FOUND" and self.dropped_from:
                self.exit(f"lost: dropped from epoch {self.dropped_from}, then unknown to a restarted lighthouse")
            elif r.code == "NOT_FOUND":
                self.register(self.held_role(), again=True)
        if self.leaving:
            return
        self.call("heartbeat", (self.step,), ok, err)
        self.c.world.after(self.c.policy.heartbeat_interval_s, lambda: self.run(self.heartbeat))

    def ask_to_join(self) -> None:
        def err(r: m.Rejection) -> None:
            if r.code in ("ABORTED", "UNAVAILABLE"):
                self.c.world.after(self.c.policy.heartbeat_interval_s, lambda: self.run(self.ask_to_join))
        def ok(a: dict[str, Any]) -> None:
            self.in_data_plane = True
        if self.member(self.known) is None:
            self.call("ready", (m.JOINING,), ok, err)

    def ready(self, role: str) -> None:
        def ok(a: dict[str, Any]) -> None:
            self.role = m.ACTIVE

        def err(r: m.Rejection) -> None:
            if r.code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT"):
                self.want_active = False
        self.call("ready", (role,), ok, err)

    def on_epoch(self, epoch: m.Epoch | None) -> None:
        """A newer epoch (pushed, or in an answer): the data plane is rebuilt for it."""
        if epoch is None or (self.known is not None and epoch.number <= self.known.number):
            return
        was = self.member(self.known)
        self.known = epoch
        me = self.member(epoch)
        if self.trainer is not None:
            self.trainer.on_epoch()
            if me is not None and self.registered and not self.trainer.started:
                joining = me.role == m.JOINING
                self.trainer.start(joining, None if joining else self.c.resume())
        if me is not None:  # as the real client's ``LighthouseRpc.saw``
            self.member_of = epoch.number
        elif self.member_of and not self.dropped_from:
            self.dropped_from = epoch.number
            self.c.dropped_seen.setdefault((self.rid, self.inc), self.now)
        if me is None:
            if was is not None and self.excluded_at is None:
                self.excluded_at = self.now  # out of the data plane: wait a bounded time for an epoch with it
                self.c.world.after(self.c.epoch_wait_s, lambda: self.run(self._give_up))
            return
        self.excluded_at = None
        if me.role == m.JOINING and not self.catching_up:
            self.catching_up = True
            self.c.world.after(self.c.world.rng.uniform(0.3, 2.0), lambda: self.run(self._caught_up))
        self.c.data_plane(self, epoch)

    def _caught_up(self) -> None:
        me = self.member(self.known)
        if self.trainer is not None and self.trainer.joining and not self.trainer.catch_up(self.source()):
            self.c.world.after(RETRY_S, lambda: self.run(self._caught_up))
            return
        if me is not None and me.role == m.JOINING:
            self.want_active = True
            self.ready(m.ACTIVE)

    def _train(self) -> None:
        """One step's worth of time: the step moves on if this replica trains (active in the epoch it knows, with
        no broken peer there); a hung or partitioned one, or one whose peers are gone, does not."""
        me = self.member(self.known)
        if me is not None and me.role == m.ACTIVE and self.known is not None and not self.c.stalled(self, self.known):
            self.step += 1
        self.c.world.after(STEP_S, lambda: self.run(self._train))

    def _first_epoch(self) -> None:
        if not self.member_of and not self.leaving:
            self.exit(f"no epoch with it within {self.c.epoch_wait_s}s of registering as {self.role}")

    def _give_up(self) -> None:
        if self.excluded_at is not None and self.now - self.excluded_at >= self.c.epoch_wait_s - 1e-9:
            self.exit(f"excluded from epoch {self.known.number if self.known else 0} for {self.c.epoch_wait_s}s")

    def report(self, suspect: str, epoch: int, early: bool) -> None:
        self.c.world.log(f"{self.inc} reports {suspect} in epoch {epoch}{' (early)' if early else ''}")
        self.call("report", (suspect, epoch, early), lambda a: None, lambda r: None)

    def finish(self, step: int) -> None:
        """The job's last step is committed: leave as finished and end."""
        if self.leaving:
            return
        self.leaving = True
        self.call("leave", (step,), lambda a: self.exit("finished", finished=True),
                  lambda r: self.exit(f"finished (leave: {r.code})", finished=True))
