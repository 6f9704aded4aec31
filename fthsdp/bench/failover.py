"""``fthsdp bench failover``: the leader lighthouse SIGKILLed -> a follower serving the next epoch to every member.

Two lighthouse processes on one loopback etcd (the HA setup of docs/lighthouse-ha-security.md), ``members``
replica clients (``LighthouseClient``, the runtime's own, given both addresses) active in one epoch. The leader
is SIGKILLed and at that instant one more replica starts joining (it registers and asks to enter, retrying
through the failover as any client does). Measured from the kill: the follower leading (its ``/status``), every
surviving member heartbeating to it, and every member, the joiner included, holding the epoch that adds the
joiner (the next epoch, served by the new leader). Each round runs both arms, in alternating order: ``knock``,
the default (a follower that finds the leader's port refusing connections takes over at once:
``lighthouse.stores.election``), and ``lease``, the baseline (``--election-probe 0``: the leader's lease has to
expire). Nothing trains: the figure is the control plane's own.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from fthsdp.launch.lighthouse_process import http_get, start_lighthouse_process
from fthsdp.launch.procutil import stop_process
from fthsdp.testing.etcd import EtcdCluster
from lighthouse import membership as m
from lighthouse.client import LighthouseClient

JOB = "default"
ARMS = ("knock", "lease")
POLL_S = 0.02
"""How often the bench looks at what it measures (a deadline bounds every wait)."""
DEADLINE_S = 60.0


@dataclass(frozen=True)
class FailoverRun:
    """One failover, times from the SIGKILL (seconds)."""

    arm: str
    lead_s: float
    """The follower's ``/status`` says it leads."""
    reconnect_s: float
    """Every surviving member heartbeats to the new leader."""
    epoch_s: float
    """Every member and the joiner hold the epoch that adds the joiner: the next epoch, served by the new leader."""
    epoch_before: int
    epoch_after: int


@dataclass
class FailoverResult:
    members: int
    rounds: int
    election_ttl_s: int
    election_probe_s: float
    heartbeat_timeout_s: float
    loadavg_before: float
    runs: list[FailoverRun] = field(default_factory=list)

    def median(self, arm: str, what: str) -> float:
        return round(statistics.median(getattr(r, what) for r in self.runs if r.arm == arm), 3)

    @property
    def ratio(self) -> float:
        """The next epoch at every member, knock over lease (medians): below 1 is faster."""
        return round(self.median("knock", "epoch_s") / self.median("lease", "epoch_s"), 3)

    def to_json(self) -> dict[str, Any]:
        arms = {a: {w: self.median(a, w) for w in ("lead_s", "reconnect_s", "epoch_s")} for a in ARMS}
        return {"benchmark": "failover", "members": self.members, "rounds": self.rounds,
                "election_ttl_s": self.election_ttl_s, "election_probe_s": self.election_probe_s,
                "heartbeat_timeout_s": self.heartbeat_timeout_s, "loadavg_before": self.loadavg_before,
                "medians": arms, "failover_median_s": self.median("knock", "epoch_s"),
                "ratio_epoch_s": self.ratio, "runs": [asdict(r) for r in self.runs]}


def format_failover(r: FailoverResult) -> str:
    lines = [f"leader lighthouse SIGKILLed, {r.members} members + 1 joining at the kill, election TTL "
             f"{r.election_ttl_s} s, {r.rounds} round(s) (1-minute load {r.loadavg_before:.2f} before)",
             f"{'arm':<8}{'follower leads':>16}{'members back':>14}{'next epoch at all':>19}"]
    for arm in ARMS:
        lines.append(f"{arm:<8}{r.median(arm, 'lead_s'):>15.2f}s{r.median(arm, 'reconnect_s'):>13.2f}s"
                     f"{r.median(arm, 'epoch_s'):>18.2f}s")
    lines.append(f"failover_median_s (next epoch at every member, knock): {r.median('knock', 'epoch_s'):.2f} s; "
                 f"knock / lease: {r.ratio}")
    return "\n".join(lines)


def _wait(what: str, ok: Any, deadline: float) -> float:
    """Poll ``ok()`` until true; the monotonic time it first was (``TimeoutError`` at the deadline)."""
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"fthsdp bench failover: {what} did not happen within {DEADLINE_S:.0f} s")
        time.sleep(POLL_S)  # polling what is measured, bounded by the deadline
    return time.monotonic()


def _status(http: str, field: str) -> bool:
    try:
        return bool(json.loads(http_get(http, "status")).get(field))
    except OSError:
        return False


def run_once(etcd: EtcdCluster, workdir: pathlib.Path, arm: str, members: int, ttl_s: int, probe_s: float,
             heartbeat_timeout_s: float, clients: list[LighthouseClient]) -> FailoverRun:
    """One failover of ``arm`` on a fresh prefix of ``etcd``. Its clients go into ``clients``, for the caller to
    close once every run is over: grpc's asyncio poller stays bound to the first event loop it served, and a
    client's close ends its loop (grpc then logs a traceback for every later wake-up)."""
    args = ["--store", etcd.url(f"bench-{uuid.uuid4().hex[:8]}"), "--election-ttl", str(ttl_s),
            "--election-probe", str(probe_s if arm == "knock" else 0.0), "--no-rendezvous",
            "--heartbeat-timeout", str(heartbeat_timeout_s)]
    procs = []
    first = len(clients)
    try:
        for name in ("leader", "follower"):
            (workdir / name).mkdir(parents=True)
            procs.append(start_lighthouse_process(args, workdir / name))
            if name == "leader":
                _wait("the first lighthouse leading", lambda: _status(procs[0][2], "leader"),
                      time.monotonic() + DEADLINE_S)
        (leader, g1, _), (_, g2, h2) = procs
        addresses = f"{g1},{g2}"
        for i in range(members):
            c = LighthouseClient(addresses, JOB, f"r{i}")
            clients.append(c)
            if c.start(deadline_s=DEADLINE_S).role != m.ACTIVE:
                c.ready(m.JOINING)
                c.ready(m.ACTIVE)
        mine = clients[first:]
        deadline = time.monotonic() + DEADLINE_S
        everyone = {f"r{i}" for i in range(members)}
        _wait("every member active in one epoch", lambda: all(
            (e := c.epoch) is not None and set(e.replica_ids) == everyone and
            all(x.role == m.ACTIVE for x in e.members) for c in mine), deadline)
        if arm == "knock":  # a follower takes over on a refused port only from a leader it has reached
            _wait("the follower reaching the leader's port", lambda: _status(h2, "leader_reached"), deadline)
        before = max(c.epoch.number for c in mine if c.epoch is not None)
        beats = [c.aio.heartbeats for c in mine]
        joiner = LighthouseClient(addresses, JOB, "joiner")
        clients.append(joiner)

        def join() -> None:
            joiner.start(deadline_s=DEADLINE_S)
            joiner.ready(m.JOINING)

        t0 = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        thread = threading.Thread(target=join, name="bench-joiner", daemon=True)
        thread.start()
        deadline = t0 + DEADLINE_S
        lead = _wait("the follower leading", lambda: _status(h2, "leader"), deadline)
        back = _wait("every member heartbeating to the new leader", lambda: all(
            c.aio.address == g2 and c.aio.heartbeats > b for c, b in zip(mine, beats, strict=True)), deadline)
        at = _wait("the next epoch at every member", lambda: all(
            (e := c.epoch) is not None and "joiner" in e.replica_ids for c in [*mine, joiner]), deadline)
        thread.join(timeout=DEADLINE_S)
        after = min(c.epoch.number for c in [*mine, joiner] if c.epoch is not None)
        return FailoverRun(arm, round(lead - t0, 3), round(back - t0, 3), round(at - t0, 3), before, after)
    finally:
        for proc, _, _ in procs:
            stop_process(proc)


def bench_failover(members: int = 8, rounds: int = 5, election_ttl_s: int = 5, election_probe_s: float = 0.25,
                   heartbeat_timeout_s: float = 3.0) -> FailoverResult:
    """``rounds`` failovers of each arm, alternating which goes first; defaults: the lighthouse's own (TTL 5 s,
    a knock every 0.25 s, heartbeat timeout 3 s: a new leader gives the members it restores that long to find
    it)."""
    if members < 1 or rounds < 1:
        raise ValueError("members and rounds must be >= 1")
    if election_ttl_s < 2 or election_probe_s <= 0:
        raise ValueError("the election TTL must be >= 2 s (etcd's shortest) and the knock period > 0")
    result = FailoverResult(members, rounds, election_ttl_s, election_probe_s, heartbeat_timeout_s,
                            round(os.getloadavg()[0], 2))
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-failover-") as tmp:
        etcd = EtcdCluster(pathlib.Path(tmp)).start()
        clients: list[LighthouseClient] = []
        try:
            for k in range(rounds):
                for arm in ARMS if k % 2 == 0 else ARMS[::-1]:
                    result.runs.append(run_once(etcd, pathlib.Path(tmp) / f"{arm}{k}", arm, members,
                                                election_ttl_s, election_probe_s, heartbeat_timeout_s, clients))
        finally:
            for c in clients:
                c.close()
            etcd.stop()
    return result
