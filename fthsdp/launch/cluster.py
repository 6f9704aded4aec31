"""Local launcher: a lighthouse and R replica groups (one torchrun of S ranks each) of the example trainer on
loopback, with failure injection and restarts. ``fthsdp run``, ``fthsdp demo``, the benchmarks and the integration
tests use it.

A replica group that exits non-zero (killed, or asking to rejoin) is restarted after ``restart_delay_s`` as a
new incarnation; it registers as joining and catches up. With ``warm_restarts`` each group has a warm standby: a
torchrun of the group started ahead and held before its registration (``FTHSDP_STANDBY_GATE``); a restart releases
it instead of starting cold, and a new standby starts once the released one has committed a step, at a low CPU
priority until it is released (``standby_nice``). Every wait has a deadline (``timeout_s``).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fthsdp.launch import priority
from fthsdp.launch.config import ClusterConfig, Kill, ReplicaFailed, check_credentials, join_window
from fthsdp.launch.epochs import epoch_events
from fthsdp.launch.lanes import lanes
from fthsdp.launch.lighthouse_process import http_get, start_lighthouse_process
from fthsdp.launch.priority import TreePriority
from fthsdp.launch.procutil import kill_group, start_group, stop_process, torchrun
from fthsdp.launch.progress import ProgressRow, ProgressTail, progress_path, slots_json, steps_of
from fthsdp.launch.recovery_metrics import Failure, recovery_metrics

log = logging.getLogger("fthsdp.launch.cluster")


@dataclass
class Standby:
    """A group's warm standby: its torchrun, held until ``gate`` exists."""

    proc: subprocess.Popen[bytes]
    gate: pathlib.Path
    log_path: pathlib.Path
    fault: Kill | None
    priority: TreePriority | None = None
    """Its tree's CPU priority while held (``ClusterConfig.standby_nice``); None: the training's."""


@dataclass
class Group:
    """One replica group under supervision: its current process and incarnation count."""

    index: int
    progress: pathlib.Path
    log_path: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    incarnations: int = 0
    started_at: float = 0.0
    finished: bool = False
    restart_at: float | None = None
    pending_faults: list[Kill] = field(default_factory=list)
    fault: Kill | None = None
    """The kill armed in the current incarnation."""
    standby: Standby | None = None
    """Its warm standby (``ClusterConfig.warm_restarts``)."""
    standbys: int = 0
    standbys_lost: int = 0
    """Its standbys that exited while held (at most ``max_restarts``)."""


class Cluster:
    """Run a job to completion; ``run()`` returns the report (see ``fthsdp demo --report``)."""

    def __init__(self, config: ClusterConfig, workdir: pathlib.Path,
                 on_tick: Callable[[Cluster], None] | None = None) -> None:
        indices = config.indices()
        for k in config.kills:
            if k.replica not in indices:
                raise ValueError(f"kill of replica {k.replica}: this launcher runs replica groups {list(indices)}")
        if not 0 <= config.standby_nice <= 19:
            raise ValueError(f"standby_nice {config.standby_nice}: a nice value from 0 (the training's) to 19")
        self.join_window_s = join_window(config, indices)  # ValueError before anything starts
        if config.credentials:
            check_credentials(config.credentials, indices, own_lighthouse=not config.lighthouse)
        self.config = config
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.on_tick = on_tick
        self.events: list[dict[str, Any]] = []
        self.groups = [Group(i, progress_path(workdir, i), workdir / f"replica{i}.log",
                             pending_faults=sorted((k for k in config.kills if k.replica == i),
                                                   key=lambda k: k.step))
                       for i in indices]
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.http = ""
        self.streams_opened: dict[str, int] = {}
        """Sessions and watch streams the lighthouse opened during the run, by kind (read before it stops)."""
        self.addr = ""
        self._tails: dict[int, ProgressTail] = {}
        self._raising: list[tuple[int, TreePriority]] = []
        """(group, its released standby's tree) not yet back at the training's priority (``_raise_released``)."""

    def event(self, kind: str, **kv: Any) -> None:
        """Record an event of the run (its report's ``events``)."""
        self.events.append({"t": time.time(), "event": kind, **kv})

    def _spawn(self, g: Group, fault: Kill | None, log_path: pathlib.Path,
               gate: pathlib.Path | None = None) -> subprocess.Popen[bytes]:
        """Start a torchrun of group ``g`` (held at ``gate`` when given: a standby)."""
        c = self.config
        env = c.replica_env(g.index, self.addr, g.progress, self.workdir, fault)
        if gate is not None:
            env["FTHSDP_STANDBY_GATE"] = str(gate)
        cmd = [*torchrun(c.ranks), *c.command] if c.command else \
            [*torchrun(c.ranks), "-m", "fthsdp.examples.train", "--steps", str(c.steps), "--model", c.model,
             "--batch", str(c.batch), "--lr", str(c.lr), "--seed", str(c.seed), "--min-step-s", str(c.min_step_s),
             "--compute-s", str(c.compute_s), "--layout", c.layout]
        return start_group(cmd, env, log_path)

    def _start_group(self, g: Group) -> None:
        """The group's next incarnation: its standby released if it has a live one, else a cold start."""
        sb, g.standby = g.standby, None
        if sb is not None and sb.proc.poll() is None:
            if sb.priority is not None:  # back to the training's priority first: it must not start starved
                self._raise(g.index, sb.priority)
            sb.gate.write_text("go\n")
            with open(g.log_path, "a") as main_log:  # where the group's output goes on, for whoever reads this one
                main_log.write(f"fthsdp launcher: replica group {g.index} incarnation {g.incarnations + 1} is a "
                               f"released warm standby: its output continues in {sb.log_path}\n")
            g.proc, g.fault, g.log_path = sb.proc, sb.fault, sb.log_path
        else:
            if sb is not None:
                self._standby_lost(g, sb)
            g.fault = g.pending_faults.pop(0) if g.pending_faults else None
            g.proc = self._spawn(g, g.fault, g.log_path)
        g.incarnations += 1
        g.started_at = time.time()
        g.restart_at = None
        self.event("start", replica=g.index, incarnation=g.incarnations, warm=sb is not None and g.proc is sb.proc,
                   fault=f"{g.fault.step}:{g.fault.phase}" if g.fault else "")

    def _ensure_standby(self, g: Group) -> None:
        """With warm restarts, start a standby for a group that has none, once its incarnation is past the start
        (its first one; a released standby once it trained a step or caught up, so the new one does not slow its
        catch-up: the zero steps it commits while catching up do not count).
        A standby that died while held is replaced (at most ``max_restarts`` times: then ``ReplicaFailed``)."""
        if not self.config.warm_restarts or g.finished or g.restart_at is not None:
            return
        if g.standby is not None:
            if g.standby.proc.poll() is None:
                return
            self._standby_lost(g, g.standby)
            g.standby = None
        if g.incarnations > 1 and not any(x.t >= g.started_at and (x.event == "active" or x.event == "step" and (
                x.contributed or x.joined)) for x in self.progress(g)):  # past its catch-up: trained, or caught up
            return
        g.standbys += 1
        fault = g.pending_faults.pop(0) if g.pending_faults else None
        gate = self.workdir / f"replica{g.index}.standby{g.standbys}.gate"
        log_path = self.workdir / f"replica{g.index}.standby{g.standbys}.log"
        proc = self._spawn(g, fault, log_path, gate)
        # Started while the job trains: lowered, where it can be raised again at its release.
        low = (g.incarnations > 1 or g.standbys > 1) and self.config.standby_nice > 0 and priority.supported()
        g.standby = Standby(proc, gate, log_path, fault,
                            TreePriority(proc.pid, self.config.standby_nice) if low else None)
        if g.standby.priority is not None:
            g.standby.priority.apply()  # the agent now; its workers, in sessions of their own, as they appear
        self.event("standby", replica=g.index, standby=g.standbys, nice=priority.nice(proc.pid) if low else 0)

    def _standby_lost(self, g: Group, sb: Standby) -> None:
        """Group ``g``'s held standby ``sb`` exited: a kill armed for it goes back to the group."""
        g.standbys_lost += 1
        self.event("standby_lost", replica=g.index, code=sb.proc.returncode)
        log.warning("replica group %d: its warm standby exited with %s while held (log: %s)", g.index,
                    sb.proc.returncode, sb.log_path)
        if sb.fault is not None:
            g.pending_faults.insert(0, sb.fault)
        if g.standbys_lost > self.config.max_restarts:
            raise ReplicaFailed(f"replica group {g.index}: {g.standbys_lost} warm standbys exited while held "
                                f"(last exit status {sb.proc.returncode}); see {sb.log_path}")

    def _lower_standbys(self) -> None:
        """Give each held standby's processes, as they appear, its priority (``standby_nice``)."""
        for g in self.groups:
            if g.standby is not None and g.standby.priority is not None and g.standby.proc.poll() is None:
                g.standby.priority.apply()

    def _raise(self, index: int, tree: TreePriority, wait_s: float = 1.0) -> None:
        """Bring group ``index``'s standby back to the training's priority before it is released: waits up to
        ``wait_s`` while the kernel rate-limits the change (an unprivileged launcher: one change per 100 ms), then
        leaves the rest to ``_raise_released``."""
        tree.want(0)
        end = time.monotonic() + wait_s
        while not tree.apply():
            if time.monotonic() > end:
                log.warning("replica group %d: its standby is released before all its processes are back at the "
                            "training's CPU priority (rate-limited; retried)", index)
                self._raising.append((index, tree))
                return
            time.sleep(0.02)  # the kernel's rate limit: a condition polled with a deadline
        self.event("standby_raised", replica=index)

    def _raise_released(self) -> None:
        """Bring released standbys back to the training's priority (retried each period while rate-limited)."""
        left = []
        for index, tree in self._raising:
            if tree.apply():
                self.event("standby_raised", replica=index)
            else:
                left.append((index, tree))
        self._raising = left

    def progress(self, g: Group) -> list[ProgressRow]:
        """Group ``g``'s progress rows so far (read as the file grows: the supervisor looks often)."""
        tail = self._tails.get(g.index)
        if tail is None:
            tail = self._tails[g.index] = ProgressTail(g.progress)
        return tail.rows()

    def status(self) -> dict[str, Any]:
        """The lighthouse's ``/status``; ``ValueError`` with an external lighthouse whose HTTP address is unknown."""
        if not self.http:
            raise ValueError("no lighthouse HTTP address to ask for its status")
        return json.loads(http_get(self.http, "status", self.config.credentials))  # type: ignore[no-any-return]

    def lighthouse_streams(self) -> dict[str, int]:
        """Sessions and watch streams the lighthouse opened so far, by kind (its ``/metrics``)."""
        return streams_text(http_get(self.http, "metrics", self.config.credentials).decode())

    def lighthouse_args(self) -> list[str]:
        c = self.config
        secret = ["--token-file", str(pathlib.Path(c.credentials) / "token")] if c.credentials else []
        return [*secret, "--heartbeat-interval", str(c.heartbeat_interval_s),
                "--heartbeat-timeout", str(c.heartbeat_timeout_s), "--confirm-age", str(c.confirm_age_s),
                "--join-window", str(self.join_window_s), "--expected-replicas", str(c.replicas + c.spares),
                "--straggler-policy", c.straggler_policy, *(["--orphan-planes"] if c.carries else []),
                *(["--lane-spread-from", str(c.lane_spread_from)] if c.lane_spread_from else [])]

    def start_lighthouse(self) -> None:
        """Start the lighthouse; set ``addr`` (what replicas get as ``FTHSDP_LIGHTHOUSE``) and ``http``. A subclass
        may start several (HA: ``addr`` is then a comma-separated list). An external one is only addressed."""
        if self.config.lighthouse:
            self.addr, self.http = self.config.lighthouse, self.config.lighthouse_http
            return
        self.lighthouse, self.addr, self.http = start_lighthouse_process(self.lighthouse_args(), self.workdir)

    def stop_lighthouse(self) -> None:
        if self.lighthouse is not None:
            stop_process(self.lighthouse)

    def run(self) -> dict[str, Any]:
        """Run the job (``execute``) and return its report."""
        t_start, history = self.execute()
        return self._report(t_start, history)

    def execute(self) -> tuple[float, list[dict[str, Any]]]:
        """Run the job until every group finished; returns its start time and the lighthouse's epoch history.
        Raises ``ReplicaFailed`` (a fatal error, or too many restarts) or ``TimeoutError``."""
        c = self.config
        self.start_lighthouse()
        t_start = time.time()
        deadline = time.monotonic() + c.timeout_s
        try:
            for g in self.groups:
                self._start_group(g)
            next_standby_check = 0.0
            while not all(g.finished for g in self.groups):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job did not finish within {c.timeout_s}s (logs in {self.workdir})")
                for g in self.groups:
                    self._supervise(g)
                if time.monotonic() >= next_standby_check:  # reads progress files: not every period
                    next_standby_check = time.monotonic() + 0.5
                    for g in self.groups:
                        self._ensure_standby(g)
                    self._lower_standbys()
                if self._raising:
                    self._raise_released()
                if self.on_tick is not None:
                    self.on_tick(self)
                time.sleep(0.02)  # supervision period
            history: list[dict[str, Any]] = self.status()["history"] if self.http else []
            self.streams_opened = self.lighthouse_streams() if self.http else {}
        finally:
            for g in self.groups:
                kill_group(g.proc)
                if g.standby is not None:
                    kill_group(g.standby.proc)
            self.stop_lighthouse()
        return t_start, history

    def _supervise(self, g: Group) -> None:
        if g.finished or g.proc is None:
            return
        if g.restart_at is not None:
            if time.monotonic() >= g.restart_at:
                self._start_group(g)
            return
        code = g.proc.poll()
        if code is None:
            return
        if code == 0:
            g.finished = True
            self.event("finished", replica=g.index)
            if g.standby is not None:  # nothing left to replace
                kill_group(g.standby.proc)
                g.standby = None
            return
        rows = [x for x in self.progress(g) if x.t >= g.started_at]
        if any(x.event == "terminated" for x in rows):
            # Stopped on request (SIGTERM) at a commit boundary, checkpoint written: done, not failed.
            g.finished = True
            self.event("terminated", replica=g.index, code=code)
            return
        self.event("exit", replica=g.index, code=code, killed=code == -signal.SIGKILL)
        if sick := [x for x in rows if x.event == "unhealthy"]:  # its host is blocklisted: not started there again
            g.finished = True
            self.event("unhealthy", replica=g.index, reason=sick[-1].error)
            return
        fatal = [x for x in rows if x.event == "fatal"]
        if fatal:
            raise ReplicaFailed(f"replica group {g.index} cannot go on: {fatal[-1].error} (log: {g.log_path})")
        if g.incarnations > self.config.max_restarts:
            raise ReplicaFailed(f"replica group {g.index} failed {g.incarnations} times (last exit status {code}); "
                                f"see {g.log_path}")
        # Killed, asked to rejoin (torchrun reports a worker's status 75 as 1), or crashed: restart it. An armed
        # kill that did not happen (the group died some other way first) is armed again in the next incarnation.
        if g.fault is not None and code != -signal.SIGKILL:
            g.pending_faults.insert(0, g.fault)
        g.restart_at = time.monotonic() + self.config.restart_delay_s

    # --- the report ---------------------------------------------------------------------------------------------

    def _report(self, t_start: float, history: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.config
        per = {g.index: self.progress(g) for g in self.groups}
        t_end = max([time.time(), *(e["t"] for e in self.events)])
        steps = {i: steps_of(rows) for i, rows in per.items()}
        exits = [Failure(e["t"], e["replica"]) for e in self.events if e["event"] == "exit"]
        m = recovery_metrics(steps, exits, c.replicas)
        median_step, survivor_stall, ett = m["median_step_s"], m["survivor_max_stall_s"], m["effective_training_time"]
        rejoin = m["rejoin_per_failure_s"]
        return {
            "replicas": c.replicas,
            "spares": c.spares,
            "ranks_per_replica": c.ranks,
            "steps": c.steps,
            "model": c.model,
            "final": finals(self),
            "unhealthy": {str(e["replica"]): e["reason"] for e in self.events if e["event"] == "unhealthy"},
            "events": self.events + epoch_events(history),
            "median_step_s": round(median_step, 4),
            "survivor_max_stall_s": round(survivor_stall, 3),
            "stall_per_failure_s": [round(x, 3) for x in m["stall_per_failure_s"]],
            "rejoin_s": round(max(rejoin), 3) if rejoin else None,
            "effective_training_time": round(ett, 3),
            "replica_steps_trained": m["replica_steps_trained"],
            "trained": m["trained"],
            **slots_json(steps),
            "ett_basis": m["ett_basis"],
            "wall_s": round(m["wall_s"], 3),
            "loss": {str(i): [[x.step, x.loss] for x in rows if x.loss is not None]
                     for i, rows in steps.items()},
            "timeline": {str(i): _segments(rows, t_start) for i, rows in steps.items()},
            "lanes": {str(i): [[s, round(a - t_start, 3), round(b - t_start, 3)]
                               for s, a, b in lanes(per[i], self.events, i, t_end)] for i in per},
            "t_start": t_start,
            "lighthouse_streams_opened": self.streams_opened,
        }


def streams_opened(http: str) -> dict[str, int]:
    """Sessions and watch streams the lighthouse at ``http`` opened so far, by kind (its ``/metrics``)."""
    return streams_text(http_get(http, "metrics").decode())


def streams_text(metrics: str) -> dict[str, int]:
    """Sessions and watch streams opened, by kind, from a lighthouse's ``/metrics`` text."""
    found = re.findall(r'^fthsdp_lighthouse_streams_opened_total\{kind="(\w+)"\} (\S+)$', metrics, re.M)
    return {kind: int(float(n)) for kind, n in found}


def _final(rows: list[ProgressRow]) -> ProgressRow | None:
    """A replica's last ``final`` row (its step and state hash), if it wrote one."""
    return next((x for x in reversed(rows) if x.event == "final"), None)


def finals(cluster: Cluster) -> dict[str, dict[str, Any] | None]:
    """Per group (by index), its final ``step`` and ``param_hash``, or None when it wrote no final state."""
    return {str(g.index): ({"step": f.step, "param_hash": f.param_hash,
                            **{k: f.extra[k] for k in ("cursors", "late") if k in f.extra}}
                           if (f := _final(cluster.progress(g))) else None)
            for g in cluster.groups}


def converged(report: dict[str, Any], steps: int) -> list[str]:
    """What is wrong with a run's end (none: it converged): every replica's final line at ``steps``, all with the
    same state hash (docs/design.md §8.1), but for a replica kept out after its self-check failed (``unhealthy``:
    it has no state), as long as one replica ended. ``fthsdp demo`` exits non-zero on any."""
    finals = {r: f for r, f in report["final"].items() if r not in report.get("unhealthy", {})}
    out = [] if finals else ["no replica ended: every one failed its self-check"]
    out += [f"replica {r} did not finish at step {steps}: {f}" for r, f in sorted(finals.items())
           if f is None or f["step"] != steps]
    hashes = {f["param_hash"] for f in finals.values() if f is not None}
    if len(hashes) > 1:
        out.append(f"replicas diverged (state hashes differ): {finals}")
    return out


def _segments(rows: list[ProgressRow], t_start: float) -> list[list[list[float]]]:
    """[time since start, step] points, one list per incarnation of the replica."""
    out: list[list[list[float]]] = []
    last: str | int | None = None
    for i, x in enumerate(rows):
        if i == 0 or x.incarnation != last:
            out.append([])
            last = x.incarnation
        out[-1].append([round(x.t - t_start, 3), x.step or 0])
    return out
