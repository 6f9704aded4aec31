"""Chaos runs: a local cluster (``fthsdp.testing.launcher``) under a seeded schedule of failures, then every invariant of
DESIGN §8 checked over what it left behind (``fthsdp.testing.invariants``).

Failures (``KINDS``):

- ``kill``: SIGKILL of a replica group at a phase of a step (forward, backward, exchange, vote, optimizer), or
  while it serves a catch-up snapshot to a joiner (``serve``: another replica is killed first so that someone
  joins), or while it fetches one (``fetch``: killed once, then again in its next incarnation mid-fetch);
- ``hang``: SIGSTOP of a whole replica group (its torchrun's process group: every rank and the heartbeats stop),
  SIGCONT a few seconds later. The others must declare it dead and go on; once continued it finds itself declared
  dead or behind, exits to rejoin and comes back;
- ``double``: two replica groups SIGKILLed at the same step (different phases);
- ``lighthouse`` (``--ha``): SIGKILL of the leading lighthouse (of 2-3 on a 3-member etcd); another takes over,
  training goes on; the killed one is restarted on its ports a few seconds later and follows;
- ``etcd`` (``--ha``): SIGKILL of one etcd member; the other two keep a quorum; restarted a few seconds later.

A fault is armed only once the previous one is over (every replica active again in the current epoch, every
lighthouse answering) and the job has reached the fault's step: a schedule never kills the last replica by
accident. Kills at a phase go through ``FTHSDP_FAULT_FILE`` (``fthsdp.testing.faults``): the runner writes ``STEP:PHASE``
into the replica's fault file when it arms the fault; rank 0 of the group SIGKILLs its torchrun when it gets there.

``schedule`` is a pure function (seed, replicas, steps, kinds -> faults); ``run_chaos`` runs one schedule and
returns its result (faults injected, violations); ``soak`` repeats runs with successive seeds (``fthsdp chaos``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

from fthsdp.testing import invariants
from fthsdp.testing.launcher import Cluster, ClusterConfig, ReplicaFailed
from fthsdp.testing.procutil import stop_process
from fthsdp.testing.lighthouse_process import start_lighthouse_process

log = logging.getLogger("fthsdp.chaos.runner")

STEP_PHASES = ("forward", "backward", "exchange", "vote", "optimizer")
KILL_PHASES = STEP_PHASES + ("serve", "fetch")
REPLICA_KINDS = ("kill", "hang", "double")
HA_KINDS = ("lighthouse", "etcd")
KINDS = REPLICA_KINDS + HA_KINDS


@dataclass(frozen=True)
class Fault:
    """One failure of a schedule. ``step``: armed once some replica committed this step (and the previous fault
    is over). ``replicas``/``phases``: the targets of a kill (two for ``double``; for a ``serve`` kill, the first
    is the joiner killed to make the second serve); ``hang_s``/``down_s``: how long a group stays stopped, a
    lighthouse or etcd member stays down."""

    kind: str
    step: int
    replicas: tuple[int, ...] = ()
    phases: tuple[str, ...] = ()
    hang_s: float = 0.0
    down_s: float = 0.0

    def describe(self) -> str:
        if self.kind == "kill":
            if self.phases[-1] == "serve":
                return f"kill r{self.replicas[1]}@serve (joiner r{self.replicas[0]}) from step {self.step}"
            if self.phases[-1] == "fetch":
                return f"kill r{self.replicas[0]} at step {self.step}, again @fetch"
            return f"kill r{self.replicas[0]}@{self.phases[0]} step {self.step}"
        if self.kind == "double":
            return (f"kill r{self.replicas[0]}@{self.phases[0]} + r{self.replicas[1]}@{self.phases[1]} "
                    f"step {self.step}")
        if self.kind == "hang":
            return f"hang r{self.replicas[0]} {self.hang_s:.1f}s from step {self.step}"
        return f"{self.kind} kill (down {self.down_s:.1f}s) at step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "describe": self.describe()}


def schedule(seed: int, replicas: int, steps: int, kinds: tuple[str, ...] = REPLICA_KINDS, count: int = 0,
             hang_s: tuple[float, float] = (6.0, 8.0), down_s: tuple[float, float] = (3.0, 5.0),
             warmup: int = 0) -> list[Fault]:
    """A seeded list of faults, ordered by step: the same arguments always give the same list.

    ``count`` (default: one per kind) faults spread over steps [warmup, 0.6 x steps]; when count >= the number
    of kinds every kind appears at least once. ``double`` needs 3 replicas (a survivor), every replica fault 2.
    Kill phases are drawn from ``KILL_PHASES``."""
    if replicas < 2 and any(k in REPLICA_KINDS for k in kinds):
        raise ValueError("replica faults need at least 2 replicas (one must survive)")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be among {KINDS}: {list(kinds)}")
    kinds = tuple(k for k in kinds if not (k == "double" and replicas < 3))
    if not kinds:
        raise ValueError("no fault kind fits: 'double' needs 3 replicas")
    rng = random.Random(seed)
    count = count or len(kinds)
    order = list(kinds) if count >= len(kinds) else []
    rng.shuffle(order)
    order += [rng.choice(kinds) for _ in range(count - len(order))]
    rng.shuffle(order)
    warmup = warmup or max(3, steps // 20)
    last = max(warmup + 1, int(steps * 0.6))
    span = (last - warmup) / count
    out = []
    for i, kind in enumerate(order):
        step = warmup + int(i * span + rng.random() * span / 2)
        if kind == "kill":
            phase = rng.choice(KILL_PHASES)
            if phase == "serve":
                joiner, source = rng.sample(range(replicas), 2)
                out.append(Fault("kill", step, (joiner, source), ("forward", "serve")))
            elif phase == "fetch":
                out.append(Fault("kill", step, (rng.randrange(replicas),), ("forward", "fetch")))
            else:
                out.append(Fault("kill", step, (rng.randrange(replicas),), (phase,)))
        elif kind == "double":
            a, b = rng.sample(range(replicas), 2)
            out.append(Fault("double", step, (a, b), (rng.choice(STEP_PHASES), rng.choice(STEP_PHASES))))
        elif kind == "hang":
            out.append(Fault("hang", step, (rng.randrange(replicas),), hang_s=round(rng.uniform(*hang_s), 2)))
        else:
            out.append(Fault(kind, step, down_s=round(rng.uniform(*down_s), 2)))
    return out


# --- a 3-member etcd on loopback -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdCluster:
    """``members`` etcd processes forming one cluster on loopback ports, in ``workdir``. Members can be SIGKILLed
    and restarted (same name, ports and data dir: they rejoin the cluster)."""

    def __init__(self, workdir: pathlib.Path, members: int = 3, binary: str = "") -> None:
        self.workdir = workdir
        self.binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(self.binary):
            raise RuntimeError("the etcd binary is missing: install Debian's etcd-server (make setup)")
        self.names = [f"e{i}" for i in range(members)]
        self.ports = [(_free_port(), _free_port()) for _ in self.names]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.token = "chaos-" + uuid.uuid4().hex[:8]

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{c}" for c, _ in self.ports)

    def url(self, prefix: str) -> str:
        return f"etcd://{self.endpoints}/{prefix}"

    def start(self, deadline_s: float = 60.0) -> EtcdCluster:
        for i in range(len(self.names)):
            self._launch(i)
        self.wait_healthy(range(len(self.names)), deadline_s)
        return self

    def _launch(self, i: int) -> None:
        client, peer = self.ports[i]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, (_, p) in zip(self.names, self.ports))
        with open(self.workdir / f"etcd-{self.names[i]}.log", "ab") as out:
            self.procs[i] = subprocess.Popen([
                self.binary, "--name", self.names[i], "--data-dir", str(self.workdir / f"etcd-{self.names[i]}"),
                "--listen-client-urls", f"http://127.0.0.1:{client}",
                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.token,
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--logger", "zap", "--log-level", "warn"], stdout=out, stderr=subprocess.STDOUT)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[i][0]}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, members: Any, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        pending = set(members)
        while pending:
            for i in list(pending):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"etcd member {self.names[i]} exited with {p.returncode} (log in "
                                       f"{self.workdir})")
                if self.healthy(i):
                    pending.discard(i)
            if pending and time.monotonic() > end:
                raise RuntimeError(f"etcd members {sorted(pending)} not healthy within {deadline_s}s")
            if pending:
                time.sleep(0.1)  # polling a condition with a deadline

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
        self.procs[i] = None

    def restart(self, i: int) -> None:
        """Start a killed member again (it rejoins with its data dir); does not wait for it."""
        assert self.procs[i] is None
        self._launch(i)

    def stop(self) -> None:
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            stop_process(p, timeout=10)
        self.procs = [None] * len(self.procs)


# --- stopping a replica group ----------------------------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    """``pid``'s descendants, from /proc (torchrun's workers run in their own sessions: a ``killpg`` of the agent's
    group does not reach them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_groups(pgids: list[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to the process group of ``pid`` (a torchrun agent started in its own session) and to the
    process group of each of its descendants (the workers); returns the groups signalled, agent's first."""
    pgids = [pid]
    for c in _descendants(pid):
        try:
            g = os.getpgid(c)
        except ProcessLookupError:
            continue
        if g not in pgids:
            pgids.append(g)
    _signal_groups(pgids, sig)
    return pgids


# --- the cluster under chaos -----------------------------------------------------------------------------------

@dataclass
class _Lighthouse:
    index: int
    workdir: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    grpc: str = ""
    http: str = ""


class ChaosCluster(Cluster):
    """A ``Cluster`` whose replicas get a fault file each, and, with ``etcd``, several lighthouses on it (the
    replicas get them all in ``FTHSDP_LIGHTHOUSE``)."""

    def __init__(self, config: ClusterConfig, workdir: pathlib.Path, injector: Injector,
                 etcd: EtcdCluster | None = None, lighthouses: int = 3, election_ttl_s: int = 2) -> None:
        self.fault_files = {i: workdir / f"replica{i}.fault" for i in range(config.replicas)}
        env = {i: {**config.env.get(i, {}), "FTHSDP_FAULT_FILE": str(self.fault_files[i])}
               for i in range(config.replicas)}
        super().__init__(dataclasses.replace(config, env=env), workdir, on_tick=injector.tick)
        self.etcd = etcd
        self.election_ttl_s = election_ttl_s
        self.lighthouses = [_Lighthouse(i, workdir / f"lighthouse{i}") for i in range(lighthouses if etcd else 0)]
        self.prefix = "chaos-" + uuid.uuid4().hex[:10]

    # lighthouses ----------------------------------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        if self.etcd is None:
            super().start_lighthouse()
            return
        for lh in self.lighthouses:
            lh.workdir.mkdir(parents=True, exist_ok=True)
            self.start_one_lighthouse(lh)
        self.addr = ",".join(lh.grpc for lh in self.lighthouses)
        self.http = self.lighthouses[0].http

    def start_one_lighthouse(self, lh: _Lighthouse) -> None:
        """Start (or restart, on the same ports) one lighthouse of the HA set."""
        assert self.etcd is not None
        args = [*self.lighthouse_args(), "--store", self.etcd.url(self.prefix),
                "--election-ttl", str(self.election_ttl_s)]
        if lh.grpc:
            args += ["--bind", lh.grpc, "--http", lh.http]  # parsed after the launcher's port-0 defaults
            (lh.workdir / "lighthouse.ports").unlink(missing_ok=True)
            log_path = lh.workdir / "lighthouse.log"
            if log_path.exists():  # the restart writes a new log: keep the killed one's
                os.replace(log_path, lh.workdir / f"lighthouse.log.{time.time():.0f}")
        lh.proc, lh.grpc, lh.http = start_lighthouse_process(args, lh.workdir)

    def stop_lighthouse(self) -> None:
        if self.etcd is None:
            super().stop_lighthouse()
            return
        live = [lh.proc for lh in self.lighthouses if lh.proc is not None and lh.proc.poll() is None]
        for proc in live:  # all at once: each one's graceful stop gives its lease back and waits on etcd
            proc.send_signal(signal.SIGTERM)
        for proc in live:
            stop_process(proc)

    def statuses(self) -> list[dict[str, Any]]:
        """The status of every lighthouse that answers (one, without HA)."""
        out = []
        for http in ([lh.http for lh in self.lighthouses if lh.proc is not None and lh.proc.poll() is None]
                     if self.etcd else [self.http]):
            try:
                with urllib.request.urlopen(f"http://{http}/status", timeout=2) as r:
                    out.append(json.load(r))
            except (urllib.error.URLError, OSError, ValueError):
                continue
        return out

    def status(self) -> dict[str, Any]:
        """The leader's status (the launcher reads the epoch history from it at the end)."""
        if self.etcd is None:
            return super().status()
        end = time.monotonic() + 30
        while True:
            leaders = [s for s in self.statuses() if s.get("leader")]
            if leaders:
                return leaders[0]
            if time.monotonic() > end:
                raise RuntimeError("no lighthouse leads (the end-of-run status cannot be read)")
            time.sleep(0.2)  # polling a condition with a deadline

    def leader(self) -> _Lighthouse | None:
        for lh in self.lighthouses:
            if lh.proc is None or lh.proc.poll() is not None:
                continue
            try:
                with urllib.request.urlopen(f"http://{lh.http}/status", timeout=2) as r:
                    if json.load(r).get("leader"):
                        return lh
            except (urllib.error.URLError, OSError, ValueError):
                continue
        return None

    # fault files ----------------------------------------------------------------------------------------------

    def arm(self, replica: int, step: int, phase: str) -> None:
        path = self.fault_files[replica]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{step}:{phase}\n")
        os.replace(tmp, path)  # a new inode: the injector notices at its next phase

    def disarm(self, replica: int) -> None:
        self.fault_files[replica].unlink(missing_ok=True)


@dataclass
class _Active:
    fault: Fault
    started: float
    stage: str = "armed"
    exits_before: dict[int, int] = dataclasses.field(default_factory=dict)
    fired: list[str] = dataclasses.field(default_factory=list)
    cont_at: float = 0.0
    restart_at: float = 0.0
    target: int = -1
    changed_at: float = 0.0
    pgids: list[int] = dataclasses.field(default_factory=list)
    seen: dict[int, int] = dataclasses.field(default_factory=dict)


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
        self.active: _Active | None = None
        self.injected: list[dict[str, Any]] = []
        self.not_fired: list[dict[str, Any]] = []
        self.epochs_seen: list[dict[str, Any]] = []
        self.cluster: ChaosCluster | None = None
        self._next_poll = 0.0
        self._healthy = False
        self._max_step = -1
        self._group_steps: dict[int, int] = {}
        self._stopped: set[int] = set()
        self._obs_t = 0.0
        self._progress: dict[int, list[dict[str, Any]]] = {}
        self._offsets: dict[int, int] = {}
        self._starts: dict[int, list[dict[str, Any]]] = {}
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
            s = [x["step"] for x in rows[-50:] if x.get("event") == "step" and x["t"] >= g.started_at]
            self._group_steps[g.index] = s[-1] if s else -1
            self._max_step = max([self._max_step] + s)
        statuses = c.statuses()
        leaders = [s for s in statuses if s.get("leader", True)]
        for s in leaders:
            hist = {h["epoch"]: h["members"] for h in s.get("history", [])}
            self.epochs_seen.append({"t": time.time(), "event": "epoch_seen", "epoch": s["epoch"],
                                     "members": hist.get(s["epoch"]), "leader": s.get("address", "")})
        self._healthy = bool(leaders) and self._whole(c, leaders[0])

    def _rows(self, replica: int, path: pathlib.Path) -> list[dict[str, Any]]:
        """The replica's progress lines, read incrementally (whole lines only); its start lines kept apart."""
        rows = self._progress.setdefault(replica, [])
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(replica, 0))
                data = f.read()
        except FileNotFoundError:
            return rows
        end = data.rfind(b"\n") + 1
        self._offsets[replica] = self._offsets.get(replica, 0) + end
        for line in data[:end].splitlines():
            try:
                x = json.loads(line)
            except ValueError:
                continue
            rows.append(x)
            if x.get("event") == "start":
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
            starts = [x for x in self._starts.get(g.index, []) if x["t"] >= g.started_at]
            if not starts or active.get(f"replica-{g.index}") != starts[-1].get("incarnation"):
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
                    self.not_fired.append({**f.to_json(), "fired": [], "why": f"not armed: past step {self.last_step}"})
                self.queue = []
                return
            self._inject(c, self.queue.pop(0))

    def _inject(self, c: ChaosCluster, f: Fault) -> None:
        a = _Active(f, time.monotonic(), changed_at=time.monotonic(), exits_before={g.index: len(self._exits(c, g.index)) for g in c.groups})
        self.active = a
        log.warning("chaos: %s", f.describe())
        c._event("chaos", fault=f.to_json())
        if f.kind in ("kill", "double"):
            targets = list(zip(f.replicas, f.phases))
            if f.kind == "kill" and f.phases[-1] == "serve":
                joiner, source = f.replicas
                c.arm(source, 0, "serve")
                c.arm(joiner, self._group_steps.get(joiner, 0) + 1, "forward")
            else:
                for r, phase in targets[:2 if f.kind == "double" else 1]:
                    c.arm(r, self._group_steps.get(r, 0) + 1, phase)
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
        elif f.kind == "lighthouse":
            lh = c.leader()
            if lh is None or lh.proc is None:
                self._done(c, a, why="no leader found")
                return
            lh.proc.send_signal(signal.SIGKILL)
            lh.proc.wait(timeout=10)
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

    def _follow(self, c: ChaosCluster, a: _Active) -> None:
        f = a.fault
        now = time.monotonic()
        if f.kind in ("kill", "double"):
            self._follow_kill(c, a)
            return
        if f.kind == "hang" and a.stage == "stopped" and now >= a.cont_at:
            _signal_groups(a.pgids, signal.SIGCONT)
            self._stopped.discard(f.replicas[0])
            a.fired.append(f"hang r{f.replicas[0]} continued after {f.hang_s:.1f}s")
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
        if a.stage == "recovering" and self._whole_since(a.changed_at):
            if f.kind == "hang":
                exits = self._exits(c, f.replicas[0])[a.exits_before[f.replicas[0]]:]
                a.fired.append(f"hung r{f.replicas[0]} exit code(s) {[e['code'] for e in exits]}, whole again")
            self._done(c, a)
        elif now - a.started > self.RECOVER_TIMEOUT_S:
            self._done(c, a, why=f"not whole again within {self.RECOVER_TIMEOUT_S}s")

    def _whole_since(self, t: float) -> bool:
        """The cluster was seen whole by an observation that began after ``t``."""
        return self._healthy and self._obs_t > t

    def _follow_kill(self, c: ChaosCluster, a: _Active) -> None:
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

    def _done(self, c: ChaosCluster, a: _Active, why: str = "") -> None:
        rec = {**a.fault.to_json(), "fired": a.fired, "took_s": round(time.monotonic() - a.started, 2)}
        if why:
            rec["why"] = why
        killed = any("SIGKILL" in x for x in a.fired) if a.fault.kind in ("kill", "double") else bool(a.fired)
        (self.injected if killed else self.not_fired).append(rec)
        if why.startswith("not whole"):
            self.stuck.append(rec)
        log.warning("chaos: %s over: %s%s", a.fault.describe(), "; ".join(a.fired), f" ({why})" if why else "")
        c._event("chaos_done", fault=a.fault.describe(), fired=a.fired, why=why)
        self.active = None

    def finish(self) -> None:
        """The run ended: SIGCONT a group left stopped; record a fault still under way."""
        a = self.active
        if a is None or self.cluster is None:
            return
        if a.fault.kind == "hang" and a.stage == "stopped":
            _signal_groups(a.pgids, signal.SIGCONT)
        self._done(self.cluster, a, why="the run ended first")


# --- one run, many runs ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChaosConfig:
    seed: int = 0
    replicas: int = 3
    steps: int = 400
    kinds: tuple[str, ...] = REPLICA_KINDS
    faults: int = 0
    """Faults per run (0: one per kind)."""
    ha: bool = False
    lighthouses: int = 3
    min_step_s: float = 0.15
    model: str = "tiny"
    ranks: int = 2
    timeout_s: float = 600.0
    heartbeat_timeout_s: float = 4.0
    collective_timeout_s: float = 4.0
    hang_s: tuple[float, float] = (6.0, 8.0)
    restart_delay_s: float = 0.5
    epoch_wait_s: float = 15.0
    """``FTHSDP_EPOCH_WAIT`` of the replicas: a replica continued after a hang finds itself out of the epoch and
    waits this long for one that has it before it exits to rejoin (the runtime's default is 60 s)."""
    last_fault_at: float = 0.7
    """No fault armed past this fraction of the steps (a replica taken down must be back before the others
    finish: a joiner finds no source once every healthy replica has left)."""


def run_chaos(cfg: ChaosConfig, workdir: pathlib.Path) -> dict[str, Any]:
    """One run of ``cfg.seed``'s schedule; the result holds the schedule, what was injected, the violations."""
    kinds = cfg.kinds if cfg.ha else tuple(k for k in cfg.kinds if k not in HA_KINDS)
    faults = schedule(cfg.seed, cfg.replicas, cfg.steps, kinds, cfg.faults, hang_s=cfg.hang_s)
    workdir.mkdir(parents=True, exist_ok=True)
    injector = Injector(faults, last_step=int(cfg.steps * cfg.last_fault_at))
    config = ClusterConfig(replicas=cfg.replicas, ranks=cfg.ranks, steps=cfg.steps, model=cfg.model,
                           seed=cfg.seed, restart_delay_s=cfg.restart_delay_s, timeout_s=cfg.timeout_s,
                           heartbeat_timeout_s=cfg.heartbeat_timeout_s, collective_timeout_s=cfg.collective_timeout_s,
                           min_step_s=cfg.min_step_s, max_restarts=4 * len(faults) + 4,
                           env={i: {"FTHSDP_EPOCH_WAIT": str(cfg.epoch_wait_s)} for i in range(cfg.replicas)})
    etcd = EtcdCluster(workdir).start() if cfg.ha else None
    t0 = time.monotonic()
    report: dict[str, Any] | None = None
    violations: list[str] = []
    cluster = ChaosCluster(config, workdir, injector, etcd=etcd, lighthouses=cfg.lighthouses)
    try:
        report = cluster.run()
    except (TimeoutError, ReplicaFailed, RuntimeError) as e:
        violations.append(f"run: {type(e).__name__}: {e}")
    finally:
        injector.finish()
        if etcd is not None:
            etcd.stop()
    violations += [f"no-hang: after {x['describe']}: {x['why']}" for x in injector.stuck]
    if report is not None:
        report["events"] += injector.epochs_seen
        per = invariants.load_run(workdir, cfg.replicas)
        violations += invariants.check_run(report, per, cfg.steps)
        (workdir / "report.json").write_text(json.dumps(report))
    else:
        # No report: still check what can be checked over the epochs seen.
        violations += [f"epochs: {v}" for v in invariants.epochs_increasing({"events": injector.epochs_seen})]
    exits = [e for e in cluster.events if e["event"] == "exit"]
    result = {
        "seed": cfg.seed, "ha": cfg.ha, "replicas": cfg.replicas, "steps": cfg.steps,
        "schedule": [f.to_json() for f in faults],
        "injected": injector.injected, "not_fired": injector.not_fired,
        "injected_by_kind": dict(collections.Counter(_kind_key(x) for x in injector.injected)),
        "exits": [{"replica": e["replica"], "code": e["code"], "killed": e["killed"]} for e in exits],
        "epochs": max((e["epoch"] for e in injector.epochs_seen), default=0),
        "violations": violations, "wall_s": round(time.monotonic() - t0, 1), "workdir": str(workdir),
    }
    (workdir / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def _kind_key(x: dict[str, Any]) -> str:
    if x["kind"] == "kill":
        return f"kill@{x['phases'][-1]}"
    return str(x["kind"])


def soak(cfg: ChaosConfig, workdir: pathlib.Path, runs: int = 1, duration_s: float = 0.0,
         keep: bool = False, on_result: Any = None) -> dict[str, Any]:
    """``runs`` runs (or as many as fit in ``duration_s``), seeds ``cfg.seed``, ``cfg.seed + 1``, ...; the
    working directory of a run without violations is removed unless ``keep``."""
    t0 = time.monotonic()
    results = []
    i = 0
    while (i < runs) if not duration_s else (time.monotonic() - t0 < duration_s):
        one = dataclasses.replace(cfg, seed=cfg.seed + i)
        d = workdir / f"seed{one.seed}"
        if d.exists():
            shutil.rmtree(d)
        r = run_chaos(one, d)
        results.append(r)
        if on_result is not None:
            on_result(r)
        if not r["violations"] and not keep:
            shutil.rmtree(d, ignore_errors=True)
        i += 1
    by_kind: collections.Counter[str] = collections.Counter()
    for r in results:
        by_kind.update(r["injected_by_kind"])
    return {
        "runs": len(results), "seeds": [r["seed"] for r in results],
        "faults_injected": sum(len(r["injected"]) for r in results), "by_kind": dict(by_kind),
        "not_fired": sum(len(r["not_fired"]) for r in results),
        "violations": {r["seed"]: r["violations"] for r in results if r["violations"]},
        "wall_s": round(time.monotonic() - t0, 1), "results": results,
    }


def summary_text(s: dict[str, Any]) -> str:
    seeds = s["seeds"]
    named = "" if not seeds else f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]}"
    lines = [(f"chaos: {s['runs']} run(s) ({named}), "
              f"{s['faults_injected']} fault(s) injected in {s['wall_s']}s, {s['not_fired']} armed but not fired")]
    for kind, n in sorted(s["by_kind"].items()):
        lines.append(f"  {kind:<16} {n}")
    if s["violations"]:
        lines.append(f"VIOLATIONS in {len(s['violations'])} run(s):")
        for seed, vs in s["violations"].items():
            for v in vs:
                lines.append(f"  seed {seed}: {v}")
    else:
        lines.append("invariants: all held (converged, survivors, exactly-once, no lost step, epochs increasing)")
    return "\n".join(lines)


def result_text(r: dict[str, Any]) -> str:
    inj = "; ".join(x["describe"] for x in r["injected"]) or "none"
    return (f"seed {r['seed']}{' (ha)' if r['ha'] else ''}: {len(r['injected'])} injected [{inj}], "
            f"{len(r['not_fired'])} not fired, {len(r['violations'])} violation(s), {r['wall_s']}s")
