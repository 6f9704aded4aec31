"""The chaos run's driver inside the launcher's supervision loop (``on_tick``): it watches the cluster (progress
rows, every lighthouse's status), arms each fault of the schedule once the previous one is over (every replica
active again in the current epoch, every lighthouse answering) and the job has reached the fault's step, follows
it until the cluster is whole again, and records what was injected.

Kills at a phase go through the replicas' fault files (``ChaosCluster.arm``): rank 0 of the group SIGKILLs its
torchrun when it gets there; hangs, rank faults, lighthouse and etcd kills are the runner's own actions
(``fthsdp.launch.procutil.signal_tree`` for a whole group, ``procutil.worker`` for one rank of it,
``fthsdp.chaos.actions``)."""

from __future__ import annotations

import logging
import os
import pathlib
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from fthsdp.chaos.actions import kill_process
from fthsdp.chaos.cluster import ChaosCluster
from fthsdp.chaos.schedule import Fault
from fthsdp.launch.cluster import Cluster
from fthsdp.launch.procutil import alive, signal_groups, signal_tree, worker
from fthsdp.launch.progress import ProgressRow, ProgressTail

log = logging.getLogger("fthsdp.chaos")


def kill_arms(f: Fault, group_steps: dict[int, int]) -> list[tuple[int, int, str]]:
    """The kills to arm now for a ``kill`` or ``double`` fault, as (replica, step, phase), each at the step after
    the one its replica last committed (``group_steps``). A ``serve`` kill arms the source at once (step 0: its
    next serve) and kills the joiner to make it serve; a ``fetch`` kill arms its first phase only (the ``fetch``
    is armed for the next incarnation once the first kill fired); a ``double`` arms both."""
    def next_step(r: int) -> int:
        return group_steps.get(r, 0) + 1

    if f.kind == "kill" and f.phases[-1] == "serve":
        joiner, source = f.replicas
        return [(source, 0, "serve"), (joiner, next_step(joiner), "forward")]
    if f.kind == "kill":
        return [(f.replicas[0], next_step(f.replicas[0]), f.phases[0])]
    if f.kind == "double":
        return [(r, next_step(r), phase) for r, phase in zip(f.replicas, f.phases, strict=True)]
    raise ValueError(f"not a kill: {f.describe()}")


@dataclass
class ActiveFault:
    """The fault under way: what was done so far (``fired``) and when its next action is due."""

    fault: Fault
    started: float
    stage: str = "armed"
    exits_before: dict[int, int] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)
    cont_at: float = 0.0
    restart_at: float = 0.0
    target: int = -1
    changed_at: float = 0.0
    pgids: list[int] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)
    """A kill's: per replica, its exits since the fault began that were recorded."""
    ended: int = 0
    """A hang's or a rank fault's: its group's exits since the fault began, as last seen."""


class Injector:
    """Drives a schedule from the launcher's supervision loop (``on_tick``): arms each fault once the cluster is
    whole again and the job reached its step, watches it happen, records what was injected."""

    POLL_S = 0.3
    ARM_TIMEOUT_S = 60.0
    """A fault armed this long without firing (its replica never got there) is given up and recorded so."""
    RECOVER_TIMEOUT_S = 180.0
    """A cluster not whole again this long after a fault: recorded (as ``stuck``), and the schedule goes on."""

    def __init__(self, faults: list[Fault], last_step: int = 1 << 62) -> None:
        self.queue = list(faults)
        self.last_step = last_step
        """No fault is armed once some replica committed this step."""
        self.active: ActiveFault | None = None
        self.injected: list[dict[str, Any]] = []
        self.not_fired: list[dict[str, Any]] = []
        self.epochs_seen: list[dict[str, Any]] = []
        self.stragglers_named: list[dict[str, Any]] = []
        """Every status answer's stragglers (``lighthouse.stragglers``), as seen while polling."""
        self.cluster: ChaosCluster | None = None
        self._next_poll = 0.0
        self._healthy = False
        self._max_step = -1
        self._group_steps: dict[int, int] = {}
        self._stopped: set[int] = set()
        self._obs_t = 0.0
        self._progress: dict[int, list[ProgressRow]] = {}
        self._tails: dict[int, ProgressTail] = {}
        self._starts: dict[int, list[ProgressRow]] = {}
        self.stuck: list[dict[str, Any]] = []

    # observations -----------------------------------------------------------------------------------------------

    def _observe(self, c: ChaosCluster) -> None:
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.POLL_S
        self._obs_t = now
        for g in c.groups:
            rows = self._rows(g.index, g.progress)
            steps = [x.step for x in rows[-50:] if x.event == "step" and x.step is not None and x.t >= g.started_at]
            self._group_steps[g.index] = steps[-1] if steps else -1
            self._max_step = max([self._max_step, *steps])
        statuses = c.statuses()
        leaders = [s for s in statuses if s.get("leader", True)]
        for s in leaders:
            hist = {h["epoch"]: h for h in s.get("history", [])}
            mine = hist.get(s["epoch"], {})
            self.epochs_seen.append({"t": time.time(), "event": "epoch_seen", "epoch": s["epoch"],
                                     "members": mine.get("members"), "reason": mine.get("reason", ""),
                                     "leader": s.get("address", "")})
            for x in s.get("stragglers") or []:  # fail-slow flags: no chaos fault makes a replica slow
                self.stragglers_named.append({"t": time.time(), "replica": x["replica_id"], "text": x["text"]})
        self._healthy = bool(leaders) and self._whole(c, leaders[0])

    def _rows(self, replica: int, path: pathlib.Path) -> list[ProgressRow]:
        """The replica's recent progress lines, read incrementally (whole lines only); its start lines kept
        apart."""
        rows = self._progress.setdefault(replica, [])
        tail = self._tails.get(replica)
        if tail is None:
            tail = self._tails[replica] = ProgressTail(path)
        for x in tail.new():
            rows.append(x)
            if x.event == "start":
                self._starts.setdefault(replica, []).append(x)
        del rows[:-100]  # the recent ones are enough here; the checks read the files afterwards
        return rows

    def _whole(self, c: ChaosCluster, status: dict[str, Any]) -> bool:
        """Every group running (not restarting, not stopped), and registered as an active member of the current
        epoch with the incarnation its latest start line names."""
        active = {m["replica_id"]: m["incarnation"] for m in status["members"] if m["role"] == "active"
                  and m["in_epoch"]}
        for g in c.groups:
            if g.finished:
                continue
            if g.proc is None or g.proc.poll() is not None or g.restart_at is not None or g.index in self._stopped:
                return False
            starts = [x for x in self._starts.get(g.index, []) if x.t >= g.started_at]
            if not starts or active.get(f"replica-{g.index}") != starts[-1].incarnation:
                return False
        if c.etcd is not None:
            if any(lh.proc is None or lh.proc.poll() is not None for lh in c.lighthouses):
                return False
            if any(p is None for p in c.etcd.procs):
                return False
        return True

    def _exits(self, c: ChaosCluster, replica: int) -> list[dict[str, Any]]:
        return [e for e in c.events if e["event"] == "exit" and e["replica"] == replica]

    # the loop -------------------------------------------------------------------------------------------------

    def tick(self, cluster: Cluster) -> None:
        c = cluster
        assert isinstance(c, ChaosCluster)
        self.cluster = c
        self._observe(c)
        if self.active is not None:
            self._follow(c, self.active)
            return
        if self.queue and self._healthy and self._max_step >= self.queue[0].step:
            if any(g.finished for g in c.groups) or self._max_step >= self.last_step:
                # Too late: the ones it would take down could not come back before the others finish.
                for f in self.queue:
                    self.not_fired.append({**f.to_json(), "fired": [],
                                           "why": f"not armed: past step {self.last_step}"})
                self.queue = []
                return
            self._inject(c, self.queue.pop(0))

    def _inject(self, c: ChaosCluster, f: Fault) -> None:
        a = ActiveFault(f, time.monotonic(), changed_at=time.monotonic(),
                        exits_before={g.index: len(self._exits(c, g.index)) for g in c.groups})
        self.active = a
        log.warning("chaos: %s", f.describe())
        c.event("chaos", fault=f.to_json())
        if f.kind in ("kill", "double"):
            for r, step, phase in kill_arms(f, self._group_steps):
                c.arm(r, step, phase)
        elif f.kind == "hang":
            r = f.replicas[0]
            g = c.groups[r]
            assert g.proc is not None
            a.target = g.proc.pid
            a.pgids = signal_tree(g.proc.pid, signal.SIGSTOP)
            self._stopped.add(r)
            a.cont_at = time.monotonic() + f.hang_s
            a.fired.append(f"hang r{r} stopped (process groups {a.pgids})")
            a.stage = "stopped"
        elif f.kind in ("rank-hang", "rank-kill"):
            r, rank = f.replicas[0], f.ranks[0]
            g = c.groups[r]
            pid = worker(g.proc.pid, rank) if g.proc is not None else None
            if pid is None:
                self._done(c, a, why=f"no worker of rank {rank} under r{r}'s torchrun")
                return
            a.target = pid
            if f.kind == "rank-kill":
                os.kill(pid, signal.SIGKILL)
                a.fired.append(f"rank {rank} of r{r} (pid {pid}) SIGKILLed alone")
                a.stage, a.changed_at = "recovering", time.monotonic()
            else:
                os.kill(pid, signal.SIGSTOP)
                a.fired.append(f"rank {rank} of r{r} (pid {pid}) stopped alone")
                a.cont_at = time.monotonic() + f.hang_s
                a.stage = "stopped"
        elif f.kind == "lighthouse":
            lh = c.leader()
            if lh is None or lh.proc is None:
                self._done(c, a, why="no leader found")
                return
            kill_process(lh.proc)
            a.target = lh.index
            a.fired.append(f"leader lighthouse {lh.index} ({lh.grpc}) SIGKILLed")
            a.restart_at = time.monotonic() + f.down_s
            a.stage = "down"
        elif f.kind == "etcd":
            assert c.etcd is not None
            i = random.Random(f.step).randrange(len(c.etcd.names))
            c.etcd.kill(i)
            a.target = i
            a.fired.append(f"etcd member {c.etcd.names[i]} SIGKILLed")
            a.restart_at = time.monotonic() + f.down_s
            a.stage = "down"

    def _follow(self, c: ChaosCluster, a: ActiveFault) -> None:
        f = a.fault
        now = time.monotonic()
        if f.kind in ("kill", "double"):
            self._follow_kill(c, a)
            return
        if f.kind == "hang" and a.stage == "stopped" and now >= a.cont_at:
            signal_groups(a.pgids, signal.SIGCONT)
            self._stopped.discard(f.replicas[0])
            a.fired.append(f"hang r{f.replicas[0]} continued after {f.hang_s:.1f}s")
            a.stage, a.changed_at = "recovering", now
        elif f.kind == "rank-hang" and a.stage == "stopped" and now >= a.cont_at:
            self._continue_rank(a)
            a.stage, a.changed_at = "recovering", now
        elif f.kind == "lighthouse" and a.stage == "down" and now >= a.restart_at:
            c.start_one_lighthouse(c.lighthouses[a.target])
            a.fired.append(f"lighthouse {a.target} restarted")
            a.stage, a.changed_at = "recovering", time.monotonic()
        elif f.kind == "etcd" and a.stage == "down" and now >= a.restart_at:
            assert c.etcd is not None
            c.etcd.restart(a.target)
            a.fired.append(f"etcd member {c.etcd.names[a.target]} restarted")
            a.stage, a.changed_at = "recovering", now
        exits = self._exits(c, f.replicas[0])[a.exits_before[f.replicas[0]]:] if f.replicas else []
        if len(exits) > a.ended:  # the group ended (again): whole only after its restart
            a.ended, a.changed_at = len(exits), now
        # A rank fault is over once its group restarted (whole before that only means nobody noticed yet).
        ended = bool(exits) or f.kind not in ("rank-hang", "rank-kill")
        if a.stage == "recovering" and ended and self._whole_since(a.changed_at):
            if f.kind in ("hang", "rank-hang", "rank-kill"):
                a.fired.append(f"r{f.replicas[0]} exit code(s) {[e['code'] for e in exits]}, whole again")
            self._done(c, a)
        elif now - a.started > self.RECOVER_TIMEOUT_S:
            self._done(c, a, why=f"not whole again within {self.RECOVER_TIMEOUT_S}s")

    @staticmethod
    def _continue_rank(a: ActiveFault) -> None:
        """SIGCONT the rank a ``rank-hang`` stopped, unless its group ended it meanwhile."""
        if alive(a.target):
            os.kill(a.target, signal.SIGCONT)
            a.fired.append(f"rank {a.fault.ranks[0]} of r{a.fault.replicas[0]} continued after {a.fault.hang_s:.1f}s")
        else:
            a.fired.append(f"rank {a.fault.ranks[0]} of r{a.fault.replicas[0]} was ended while stopped")

    def _whole_since(self, t: float) -> bool:
        """The cluster was seen whole by an observation that began after ``t``."""
        return self._healthy and self._obs_t > t

    def _follow_kill(self, c: ChaosCluster, a: ActiveFault) -> None:
        f = a.fault
        fetch = f.kind == "kill" and f.phases[-1] == "fetch"
        for r in sorted(set(f.replicas)):
            new = self._exits(c, r)[a.exits_before[r]:]
            for n, e in enumerate(new[a.seen.get(r, 0):], start=a.seen.get(r, 0) + 1):
                a.fired.append(f"r{r} exit #{n} code {e['code']}{' (SIGKILL)' if e['killed'] else ''}")
                a.changed_at = time.monotonic()
                if fetch and n == 1:
                    c.arm(r, 0, "fetch")  # read by the next incarnation (it restarts in restart_delay_s)
                    a.fired[-1] += "; armed @fetch in the next incarnation"
                else:
                    c.disarm(r)
            a.seen[r] = len(new)
        # The kills that must happen before the fault can be over: the target (the joiner for a serve kill, the
        # first kill for a fetch kill), or both for a double. A serve source or a fetch kill that does not fire
        # (another source chosen, the fetch over before the file was read) ends with the cluster whole again.
        required = f.replicas if f.kind == "double" else f.replicas[:1]
        if all(a.seen.get(r, 0) >= 1 for r in required):
            if self._whole_since(a.changed_at):
                for r in set(f.replicas):
                    c.disarm(r)
                self._done(c, a)
            elif time.monotonic() - a.changed_at > self.RECOVER_TIMEOUT_S:
                self._done(c, a, why=f"not whole again within {self.RECOVER_TIMEOUT_S}s")
        elif time.monotonic() - a.started > self.ARM_TIMEOUT_S:
            for r in set(f.replicas):
                c.disarm(r)
            self._done(c, a, why="armed but never fired")

    def _done(self, c: ChaosCluster, a: ActiveFault, why: str = "") -> None:
        rec = {**a.fault.to_json(), "fired": a.fired, "took_s": round(time.monotonic() - a.started, 2)}
        if why:
            rec["why"] = why
        killed = any("SIGKILL" in x for x in a.fired) if a.fault.kind in ("kill", "double") else bool(a.fired)
        (self.injected if killed else self.not_fired).append(rec)
        if why.startswith("not whole"):
            self.stuck.append(rec)
        log.warning("chaos: %s over: %s%s", a.fault.describe(), "; ".join(a.fired), f" ({why})" if why else "")
        c.event("chaos_done", fault=a.fault.describe(), fired=a.fired, why=why)
        self.active = None

    def finish(self) -> None:
        """The run ended: SIGCONT a group left stopped; record a fault still under way."""
        a = self.active
        if a is None or self.cluster is None:
            return
        if a.fault.kind == "hang" and a.stage == "stopped":
            signal_groups(a.pgids, signal.SIGCONT)
        if a.fault.kind == "rank-hang" and a.stage == "stopped":
            self._continue_rank(a)
        self._done(self.cluster, a, why="the run ended first")
