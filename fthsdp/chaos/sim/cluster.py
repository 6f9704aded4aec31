"""A simulated job: R replica groups under supervisors (a group that exits restarts as a new incarnation), the
lighthouse, the network, the data plane and a seeded fault schedule.

With lanes (``SimConfig.lanes``), every replica's ranks run FTAR lanes over the epochs' groups
(``fthsdp.chaos.sim.lanes``) and its training loop runs the commit protocol (``fthsdp.chaos.sim.trainer``); the
job ends at its last step, and the cluster records what every commit applied for the checks. Without lanes the
data plane is only a model of failure detection: a member of an epoch whose peer in that epoch is dead, hung or
cut from it sees its collective fail (soon for a dead peer, whose connections reset; after the collective timeout
otherwise) and reports that peer for the epoch, as FTAR's blame does; at ``end_s`` every replica that is active in
the epoch it knows leaves as finished.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from fthsdp.chaos.sim import trainer as tr
from fthsdp.chaos.sim.lanes import LaneConfig, SimGroup
from fthsdp.chaos.sim.lighthouse import SimLighthouse
from fthsdp.chaos.sim.replica import SimReplica
from fthsdp.chaos.sim.world import Net, Window, World
from fthsdp.runtime import orphans
from lighthouse import membership as m
from lighthouse.epoch_view import EpochView

FAULT_KINDS = ("kill", "double", "hang", "cut", "blip", "peers", "delay", "dup", "blame", "restart-memory",
               "restart-durable")
"""``kill`` (a group's processes die), ``double`` (two at once), ``hang`` (SIGSTOP for 4-8 s), ``cut`` (the group
and the lighthouse cannot reach each other for 0.4-8 s: silent for the confirm age, a report against it is
confirmed), ``blip`` (the same for 0.1-0.4 s, less than the confirm age less an interval: it must cost nothing),
``peers`` (the group and its peers cannot reach each other for 3-8 s; the lighthouse sees everyone), ``delay``
(its messages up to 0.3 s late: reordered), ``dup`` (its requests arrive twice), ``blame`` (a peer reports it
though it is healthy: a slow link), ``restart-memory`` and ``restart-durable`` (the lighthouse crashes and comes
back 0.5-3 s later without or with its state)."""
PLANE_FAULT_KINDS = ("store-leader",)
"""Drawn for the lanes plane only: ``store-leader`` (the durable store loses its leader: 0.5-3 s during which every
write the lighthouse tries is refused as unavailable, as an etcd leader election makes it; nothing after a restart
on an in-memory store)."""
BLAME_ALL = "blame-all"
"""Drawn only on request (``run_one(blame_all=True)``, ``fthsdp chaos --sim --sim-blame-all``), from a stream of its
own: one member (a faulty host, or a bug) reports every other member of each epoch it sees as failed, every
``BLAME_EVERY_S``, for 3-8 s, while nobody blames it and the others' steps go on. It is that member that may pay
(issue 41: one member's blame must never empty a job)."""
BLAME_EVERY_S = 0.5
MID_EXCHANGE_WAIT_S = 3.0
"""How long a mid-exchange kill waits for a collective of its replicas before it kills them anyway."""
TARGETING = frozenset({"kill", "double", "hang", "cut", "peers", BLAME_ALL})
"""The kinds whose replicas may pay (invariant 7 holds every other replica to one incarnation)."""


@dataclass(frozen=True)
class Fault:
    t: float
    kind: str
    replicas: tuple[int, ...]
    duration_s: float = 0.0
    durable: bool = False
    mid_exchange: bool = False
    """With lanes, a ``kill`` or ``double`` waits for the next collective of its replicas to complete at some
    members and kills them then, before it completes at the others (within ``MID_EXCHANGE_WAIT_S``)."""

    def describe(self) -> str:
        who = ",".join(f"r{i}" for i in self.replicas)
        return f"{self.kind}({who}) at {self.t:.3f}s" + (f" for {self.duration_s:.2f}s" if self.duration_s else "") \
            + (" mid-exchange" if self.mid_exchange else "")


@dataclass
class Exit:
    t: float
    replica: int
    incarnation: str
    why: str
    finished: bool


@dataclass
class Supervisor:
    index: int
    proc: SimReplica | None = None
    incarnations: int = 0
    done: bool = False


@dataclass
class SimConfig:
    """One simulated job: its shape, its faults, its timing and the lighthouse's policy."""

    replicas: int = 3
    min_replicas: int = 1
    faults: tuple[Fault, ...] = ()
    end_s: float = 60.0
    """When the job's last step is committed."""
    epoch_wait_s: float = 10.0
    """``FTHSDP_EPOCH_WAIT``: how long a replica waits for an epoch that has it."""
    collective_timeout_s: float = 4.0
    """``FTHSDP_TIMEOUT``: a collective with a hung or cut-off peer fails after this long."""
    policy: m.Policy = field(default_factory=m.Policy)
    reuse_epochs: bool = False
    """Variant ``reuse-epochs``: the store keeps no epoch counter and re-registrations claim no epoch."""
    lanes: int = 0
    """Ranks (FTAR lanes) per replica; 0: no data plane, the step is a clock while a replica trains and failure
    reports come from a model of FTAR's blame (the membership layer alone)."""
    buckets: int = 1
    """Gradient buckets per step (one exchange each on every lane)."""
    reconcile: bool = True
    """FTAR's step reconciliation; off in the ``local-vote`` variant."""
    spares: int = 0
    """Spare groups besides ``replicas`` (``fthsdp chaos --sim --sim-spares``): they ask for no data slot and take a
    dead replica's (``lighthouse.slots``); 0: the replicas name no slots, as before spares existed."""
    orphans: bool = False
    """Orphan slots (``fthsdp chaos --sim --sim-orphans``; docs/design.md §7, the designed constant global batch):
    the slot holders train the batches of the slots nobody holds, and every committed step must train every slot."""
    pin_deals: bool = True
    """With ``orphans``: a contribution is exchanged only in a group whose epoch deals its member what it trained
    (off in the ``unpinned-orphans`` variant)."""


def twice(record: tr.Record) -> list[tuple[int, ...]]:
    """The contributing slots of a committed step that name a slot more than once (two members trained one slot's
    batch in one step: exactly-once broken; the runtime's ``contributing_slots`` raises ``SlotConflict``)."""
    return sorted({by for _, _, by in record if len(set(by)) != len(by)})


class SimCluster:
    """The job's supervisors, network, lighthouse and data-plane model; what the checks read afterwards."""

    def __init__(self, world: World, cfg: SimConfig) -> None:
        self.world, self.cfg = world, cfg
        self.policy = dataclasses.replace(cfg.policy, min_replicas=cfg.min_replicas,
                                          expected_replicas=cfg.replicas + cfg.spares, orphan_planes=cfg.orphans)
        self.slots, self.spares, self.orphans = cfg.replicas, cfg.spares, cfg.orphans
        self.epoch_wait_s = cfg.epoch_wait_s
        self.reuse_epochs = cfg.reuse_epochs
        self.net = Net(world)
        self.lighthouse = SimLighthouse(world, self.policy, self._publish, strip_counter=cfg.reuse_epochs)
        self.groups = [Supervisor(i) for i in range(cfg.replicas + cfg.spares)]
        self.exits: list[Exit] = []
        self.carried: set[int] = set()
        """With orphan slots: the committed steps in which a member trained parts of a slot it does not hold."""
        self.stale: list[str] = []
        self.dropped_seen: dict[tuple[str, str], float] = {}
        """(replica, incarnation) -> when its process first saw an epoch drop it."""
        self.at_end: dict[str, Any] = {}
        self.total_steps = int(cfg.end_s / tr.STEP_S) + 2
        """With lanes, the job's steps: the first replica finishes after ``end_s``."""
        self._planes: dict[tuple[int, int, tuple[tuple[str, str], ...]], SimGroup] = {}
        self.checkpoint: tuple[int, dict[int, tr.Record]] | None = None
        """The newest state any replica committed (a checkpoint at every commit): what a replica that starts active
        resumes from."""
        self.trainers: list[tr.SimTrainer] = []
        """Every incarnation's, for the checks."""
        self.plane_violations: list[str] = []
        self._armed: list[Fault] = []
        """Mid-exchange kills waiting for a collective of their replicas."""
        self.finished_states: dict[str, tuple[int, int]] = {}
        """Incarnation -> (its step, its history's hash) when it left as finished."""
        for g in self.groups:
            self._start(g, cold_s=world.rng.uniform(0.5, 2.0))
        for f in cfg.faults:
            world.at(f.t, functools.partial(self._inject, f))
        world.at(cfg.end_s, self._end)

    # --- supervision ------------------------------------------------------------------------------------------

    def _start(self, g: Supervisor, cold_s: float) -> None:
        g.incarnations += 1
        g.proc = SimReplica(self, g.index, g.incarnations)
        g.proc.start(cold_s)

    def exited(self, proc: SimReplica, why: str, finished: bool) -> None:
        self.exits.append(Exit(self.world.now, proc.index, proc.inc, why, finished))
        t = proc.trainer
        if finished and t is not None and t.barrier:
            self.finished_states[proc.inc] = (t.step, hash(tuple(sorted(t.history.items()))))
        g = self.groups[proc.index]
        if finished:
            g.done = True
            return
        self.world.after(self.world.rng.uniform(0.5, 2.0), lambda: self._start(g, self.world.rng.uniform(1.0, 3.0)))

    def process(self, rid: str) -> SimReplica | None:
        g = self.groups[int(rid[1:])]
        return g.proc

    # --- epochs and the data plane ----------------------------------------------------------------------------

    def _publish(self, epoch: m.Epoch) -> None:
        for g in self.groups:  # every live process must take it: one that saw a number as high ignores it
            p = g.proc
            if p is not None and p.alive and p.known is not None and p.known.number >= epoch.number \
                    and p.known.key() != epoch.key():
                self.stale.append(f"epoch {epoch.number} published while {p.inc} had seen epoch {p.known.number} "
                                  "(another membership): it ignores the new one")
        for g in self.groups:
            p = g.proc
            if p is not None and p.alive and p.registered:
                when = self.net.reconnect_at(p.rid) + self.net.latency(p.rid)
                self.world.at(when, functools.partial(self._deliver, p, epoch))

    def _deliver(self, p: SimReplica, epoch: m.Epoch) -> None:
        p.run(lambda: p.on_epoch(self._fresh(epoch)))

    def watch_opened(self, p: SimReplica) -> None:
        """A process that registered opens its watch stream: the first thing on it is the current epoch."""
        def deliver() -> None:
            cur = self.lighthouse.current() if self.lighthouse.up else None
            if cur is not None:
                p.run(lambda: p.on_epoch(cur))
        self.world.at(self.net.reconnect_at(p.rid) + self.net.latency(p.rid), deliver)

    def _fresh(self, epoch: m.Epoch) -> m.Epoch:
        """What a watch stream hands over when it delivers: the epoch, or a newer one the lighthouse has by then
        (a reconnecting stream asks for the epochs after the last it saw)."""
        cur = self.lighthouse.current()
        return cur if self.lighthouse.up and cur is not None and cur.number > epoch.number else epoch

    # --- with lanes ------------------------------------------------------------------------------------------------

    def new_trainer(self, proc: SimReplica) -> tr.SimTrainer | None:
        cfg = self.cfg
        if not cfg.lanes:
            return None
        lanes = LaneConfig(timeout_s=cfg.collective_timeout_s, connect_timeout_s=cfg.collective_timeout_s,
                           epoch_wait_s=cfg.epoch_wait_s, reconcile=cfg.reconcile)
        t = tr.SimTrainer(proc, cfg.lanes, cfg.buckets, cfg.replicas, self.total_steps, lanes, self._group,
                          self._record, assigned=cfg.spares > 0, orphans=cfg.orphans, pin=cfg.pin_deals)
        self.trainers.append(t)
        return t

    def _group(self, epoch: EpochView, lane: int) -> SimGroup:
        """The group of ``epoch``'s data plane on ``lane`` (an epoch that only changed roles keeps its plane's; a
        lighthouse restarted without its store numbers epochs afresh, for new incarnations: they are not the old
        epochs' groups)."""
        key = (epoch.data_plane, lane, tuple((x.replica_id, x.incarnation) for x in epoch.members))
        group = self._planes.get(key)
        if group is None:
            group = self._planes[key] = SimGroup(self.world, epoch, lane, self._blocked_until, self._reduced)
        return group

    def _blocked_until(self, group: SimGroup) -> float | None:
        """When every member of ``group`` can reach the others again (None: now): hangs and peer cuts hold it."""
        until = None
        for rid in group.ids:
            p = self.process(rid)
            ends = [p.hung_until] if p is not None and p.alive and p.hung() else []
            ends += [w.end for w in self.net.windows.get(rid, ()) if w.kind == "peers"
                     and w.start <= self.world.now < w.end]
            if ends:
                until = max(until or 0.0, *ends)
        return until

    def _record(self, who: tr.SimTrainer, step: int, record: tr.Record) -> None:
        """A commit: each result must be the exact sum of its contributors' gradients, in one set of contributors
        for the whole step (that every replica applies the same step is checked at the end:
        ``checks.histories_agree``). The committer's state is the job's newest checkpoint if it is the newest."""
        if self.checkpoint is None or step + 1 > self.checkpoint[0]:
            self.checkpoint = (step + 1, {**who.history, step: record})
        slots = {r[2] for r in record}
        if len(slots) != 1:
            self.plane_violations.append(f"state: step {step} at {who.inc} mixes contributors {sorted(slots)}")
        for by in twice(record):
            self.plane_violations.append(f"exactly-once: step {step} at {who.inc}: slots {by} (one slot trained "
                                         "twice in a step)")
        if self.orphans:
            self._whole_batch(who, step, record[-1][2])
            if len(record[-1][2]) > record[-1][1] * who.parts:  # someone trained more than its own slot
                self.carried.add(step)
        k = 0
        for lane in range(len(who.lanes)):
            for b in range(who.buckets):
                value, contributors, by = record[k]
                k += 1
                want = sum(tr.grad(s, step, lane, b) for s in by)
                # one position per contributor; with orphan slots at least its own slot's parts each
                counted = contributors == len(by) if who.parts == 1 else contributors * who.parts <= len(by)
                if value != want or not counted:
                    self.plane_violations.append(f"state: step {step} lane {lane} bucket {b} at {who.inc}: sum "
                                                 f"{value} of {contributors}, the slots {by} give {want}")

    def _whole_batch(self, who: tr.SimTrainer, step: int, positions: tuple[int, ...]) -> None:
        """With orphan slots: the step trained every part of every slot exactly once (a slot's parts by one holder
        or dealt among them: ``fthsdp.runtime.orphans.trained``), so the global batch is the same, failures or not."""
        try:
            slots = orphans.trained(orphans.counts(positions, self.slots, who.parts), who.parts, step)
        except orphans.OrphanConflict as e:
            self.plane_violations.append(f"exactly-once: at {who.inc}: {e}")
            return
        if len(slots) != self.slots:
            self.plane_violations.append(f"whole-batch: step {step} at {who.inc} trained slots {list(slots)} of "
                                         f"{self.slots}")

    def resume(self) -> tuple[int, dict[int, tr.Record]] | None:
        """The job's newest checkpoint, or None before any commit."""
        return self.checkpoint

    def source_for(self, proc: SimReplica) -> tr.SimTrainer | None:
        """A live replica of ``proc``'s epoch that holds the job's state (for its catch-up)."""
        if proc.known is None:
            return None
        for x in proc.known.members:
            p = self.process(x.replica_id)
            if p is not None and p is not proc and p.alive and p.trainer is not None and p.trainer.started \
                    and not p.trainer.joining and not p.hung():
                return p.trainer
        return None

    def broken(self, viewer: SimReplica, member: m.EpochMember) -> str:
        """Why ``viewer``'s collectives with ``member`` fail ('' when they do not)."""
        p = self.process(member.replica_id)
        if p is None or p.inc != member.incarnation or not p.alive:
            return "dead"
        if p.hung():
            return "hung"
        if self.net.cut_from_peers(member.replica_id) or self.net.cut_from_peers(viewer.rid):
            return "cut"
        return ""

    def stalled(self, viewer: SimReplica, epoch: m.Epoch) -> bool:
        """Whether ``viewer``'s collectives in ``epoch`` fail (a peer there is broken): it trains no step."""
        return any(x.replica_id != viewer.rid and self.broken(viewer, x) for x in epoch.members)

    def data_plane(self, viewer: SimReplica, epoch: m.Epoch) -> None:
        """``viewer`` runs in ``epoch``: its collectives fail on every broken peer, and it reports them (without
        lanes: with lanes, the lanes' own collectives fail and blame)."""
        if self.cfg.lanes:
            return
        for x in epoch.members:
            if x.replica_id != viewer.rid:
                why = self.broken(viewer, x)
                if why:
                    self._detect(viewer, epoch.number, x, why)

    def _detect(self, viewer: SimReplica, number: int, suspect: m.EpochMember, why: str) -> None:
        fast = why == "dead"
        delay = self.world.rng.uniform(0.01, 0.3) if fast else self.cfg.collective_timeout_s + \
            self.world.rng.uniform(0.0, 0.5)

        def check() -> None:
            if viewer.known is None or viewer.known.number != number or viewer.member(viewer.known) is None:
                return  # a newer epoch: evaluated when it came
            if not self.broken(viewer, suspect):
                return  # it healed before the collective gave up
            if fast:  # FTAR's early report within the blame grace, then the full one
                viewer.report(suspect.replica_id, number, early=True)
                self.world.after(0.2, lambda: viewer.run(lambda: late()))
            else:
                viewer.report(suspect.replica_id, number, early=False)

        def late() -> None:
            if viewer.known is not None and viewer.known.number == number:
                viewer.report(suspect.replica_id, number, early=False)
        self.world.after(delay, lambda: viewer.run(check))

    def _broke(self, index: int) -> None:
        """Replica ``index`` just broke: every member of an epoch with it notices in its collectives (without
        lanes)."""
        if self.cfg.lanes:
            return
        for g in self.groups:
            p = g.proc
            if p is None or not p.alive or p.index == index or p.member(p.known) is None:
                continue
            assert p.known is not None
            x = p.known.member(f"r{index}")
            if x is not None:
                why = self.broken(p, x)
                if why:
                    self._detect(p, p.known.number, x, why)
        p = self.groups[index].proc
        if p is not None and p.alive and p.known is not None and p.member(p.known) is not None:
            self.data_plane(p, p.known)  # cut from its peers: it misses all of them

    # --- faults -----------------------------------------------------------------------------------------------

    def _inject(self, f: Fault) -> None:
        self.world.log(f"FAULT {f.describe()}")
        if f.kind in ("kill", "double") and f.mid_exchange and self.cfg.lanes:
            self._armed.append(f)
            self.world.after(MID_EXCHANGE_WAIT_S, functools.partial(self._fire, f))
        elif f.kind in ("kill", "double"):
            self._kill(f)
        elif f.kind == "hang":
            p = self.groups[f.replicas[0]].proc
            if p is not None and p.alive:
                p.hung_until = self.world.now + f.duration_s
                self._broke(p.index)
        elif f.kind in ("cut", "blip", "peers", "delay", "dup"):
            kind = "cut" if f.kind == "blip" else f.kind
            rid = f"r{f.replicas[0]}"
            self.net.windows.setdefault(rid, []).append(Window(self.world.now, self.world.now + f.duration_s, kind,
                                                               extra_s=0.3))
            if kind == "peers":
                self._broke(f.replicas[0])
        elif f.kind == "store-leader":  # a lighthouse restarted on an in-memory store has no store leader to lose
            if self.lighthouse.lives[-1]:
                self.lighthouse.store_down_until = self.world.now + f.duration_s
        elif f.kind == "blame":
            self._false_blame(f.replicas[0])
        elif f.kind == BLAME_ALL:
            self._blame_everyone(f.replicas[0], self.world.now + f.duration_s)
        elif f.kind.startswith("restart"):
            self.lighthouse.restart(f.duration_s, durable=f.durable)
            self.net.lighthouse_down_until = self.world.now + f.duration_s
            cur = self.lighthouse

            def republish() -> None:  # the watch streams reconnect and get the epoch the lighthouse has
                epoch = cur.current()
                if cur.up and epoch is not None:
                    self._publish(epoch)
            self.world.after(f.duration_s + 0.01, republish)

    def _kill(self, f: Fault) -> None:
        for i in f.replicas:
            p = self.groups[i].proc
            if p is not None and p.alive:
                p.exit("SIGKILL")
                if not self.net.cut_from_lighthouse(p.rid):
                    self.world.after(self.net.latency(p.rid),
                                     functools.partial(self.lighthouse.stream_closed, p.rid, p.inc))
        for i in f.replicas:
            self._broke(i)

    def _fire(self, f: Fault) -> None:
        """A mid-exchange kill that found no collective in time: now."""
        if f in self._armed:
            self._armed.remove(f)
            self._kill(f)

    def _reduced(self, group: SimGroup, first_s: float, last_s: float) -> None:
        """A collective of ``group`` completes at its members between ``first_s`` and ``last_s`` from now: an armed
        mid-exchange kill of one of them lands in between."""
        for f in self._armed:
            if any(f"r{i}" in group.ids for i in f.replicas):
                self._armed.remove(f)
                self.world.log(f"mid-exchange kill in epoch {group.epoch.number} lane {group.lane}")
                self.world.after(self.world.rng.uniform(first_s, last_s), functools.partial(self._kill, f))
                return

    def _false_blame(self, suspect: int) -> None:
        for g in self.groups:
            p = g.proc
            if p is not None and p.alive and p.index != suspect and p.member(p.known) is not None:
                assert p.known is not None
                if p.known.member(f"r{suspect}") is not None:
                    p.run(functools.partial(p.report, f"r{suspect}", p.known.number, False))
                    return

    def _blame_everyone(self, blamer: int, until: float) -> None:
        """The ``blame-all`` fault: the blamer's current incarnation reports every other member of the newest epoch
        it knows, again every ``BLAME_EVERY_S`` until ``until``."""
        p = self.groups[blamer].proc
        if self.world.now >= until:
            return
        if p is not None and p.alive and p.known is not None and p.member(p.known) is not None:
            for x in p.known.members:
                if x.replica_id != p.rid:
                    p.run(functools.partial(p.report, x.replica_id, p.known.number, False))
        self.world.after(BLAME_EVERY_S, functools.partial(self._blame_everyone, blamer, until))

    # --- the end ----------------------------------------------------------------------------------------------

    def _end(self) -> None:
        lh = self.lighthouse
        cur = lh.current() if lh.up else None
        self.at_end = {
            "lighthouse_up": lh.up,
            "epoch": None if cur is None else cur.number,
            "members": {} if cur is None else {x.replica_id: (x.incarnation, x.role) for x in cur.members},
            "processes": {g.index: None if g.proc is None or not g.proc.alive else
                          {"inc": g.proc.inc, "known": g.proc.known.number if g.proc.known else 0,
                           "hung": g.proc.hung(), "excluded": g.proc.excluded_at is not None}
                          for g in self.groups},
        }
        if self.cfg.lanes:
            return  # the replicas finish at the job's last step
        for g in self.groups:
            p = g.proc
            me = p.member(p.known) if p is not None and p.alive else None
            if p is not None and me is not None and me.role == m.ACTIVE and not p.hung():
                p.finish(step=1000)
