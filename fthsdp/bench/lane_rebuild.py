"""``fthsdp bench lighthouse``'s lane part (issue 39): after a SIGKILL of one replica group, how long until every
surviving lane's new rendezvous is complete, and what the lighthouse served for it, with the lanes' rendezvous on
their members' stores (``--rendezvous-on members``, the default) and, as the baseline in the same invocation, on the
lighthouse (``--rendezvous-on lighthouse``, as before).

A real lighthouse process, N emulated replica groups (``fthsdp.bench.emulate``: their sessions, epochs pushed) and
emulated lanes (``fthsdp.bench.lanes``: the real rendezvous protocol, stores and authentication, no tensors). Every
lane of a replica group of R ranks is alike, and after a death each meets on its own host (members) or on the one
lighthouse (baseline), so the benchmark emulates a sample of the lanes (``lanes``), whole: every member of each. On
2 cores the sample's ranks share the machine with the lighthouse and the emulator; in a deployment each lane's host
is a rank of its own host. What the sample cannot show, the lighthouse's load from all R lanes at once in the
baseline, is projected from what it measured: its calls per lane times R, at its CPU per call (its event loop
serves them one at a time: a lower bound on the baseline's rebuild). Member hosting sends the lighthouse no call.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from ftar.store import StoreTarget
from fthsdp.bench.emulate import EmulatedReplica, Emulator, collector_paused
from fthsdp.bench.lanes import LaneEmulator
from fthsdp.bench.procstat import cpu_seconds, pct
from fthsdp.bench.results import _AsJson
from fthsdp.launch.lighthouse_process import start_lighthouse_process
from fthsdp.launch.procutil import stop_process
from lighthouse import lane_hosts
from lighthouse.credentials import catchup_key
from lighthouse.epoch_view import EpochView
from lighthouse.security import ClientSecurity

JOB = "default"
SAMPLE_RANKS = 240
"""Emulated ranks per measurement (lanes sampled × members per lane), what 2 cores carry beside a lighthouse."""


@dataclass(frozen=True)
class LaneRebuild(_AsJson):
    """One way of meeting (``rendezvous_on``) at one size."""

    rendezvous_on: str
    lanes_total: int
    lanes_sampled: int
    members_per_lane: int
    """A lane's members after a death: the replica groups less the dead one."""
    backend: str
    """The backend's own connect the emulated ranks make (``fthsdp.bench.lanes.BACKENDS``)."""
    deaths: int
    lane_rebuild_p50_s: float
    lane_rebuild_p99_s: float
    """Kill -> the sampled lane's last surviving member finished its new rendezvous, over every lane and death."""
    lighthouse_calls_per_change: float
    """Rendezvous calls the lighthouse served per death (the sample's)."""
    lighthouse_calls_per_change_projected: float
    """The same for every lane of the job (calls per sampled lane x lanes)."""
    lighthouse_cpu_s_per_change: float
    """The lighthouse's CPU from the kill until the sample's lanes were rebuilt (detection, the epoch, its push and
    what it served)."""
    lighthouse_cpu_us_per_call: float | None
    lighthouse_rebuild_projected_s: float | None
    """Baseline: the projected calls at the measured CPU per call, one at a time: the least the last lane waits."""
    errors: list[str]


def _rendezvous_calls(http: str, token: str) -> float:
    req = urllib.request.Request(f"http://{http}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback)
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("fthsdp_lighthouse_rendezvous_calls_total{"))


async def _one(n: int, ranks: int, lanes: int, deaths: int, backend: str, rendezvous_on: str) -> LaneRebuild:
    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-lanes-") as tmp:
        token_file = pathlib.Path(tmp) / "token"
        token_file.write_text(secret)
        interval = max(1.0, n / 1000)
        proc, addr, http = start_lighthouse_process(
            ["--heartbeat-interval", str(interval), "--heartbeat-timeout", str(max(5 * interval, 30 + n / 100)),
             "--confirm-age", str(interval), "--expected-replicas", str(n), "--max-members", str(max(n, 4096)),
             "--rendezvous-on", rendezvous_on, "--token-file", str(token_file)], pathlib.Path(tmp))
        security = ClientSecurity(token=secret)
        sample = list(range(lanes))
        emu_lanes = LaneEmulator(sample, JOB, catchup_key(secret, JOB), StoreTarget(addr, security, JOB), backend,
                                 workers=min(1024, n * lanes + 16))

        def on_epoch(r: EmulatedReplica, e: Any) -> None:
            emu_lanes.on_epoch(r.replica_id, e)

        emu = Emulator(addr, n, prefix="lanes", rpc_timeout_s=max(5.0, n / 250), ranks=ranks, security=security,
                       on_epoch=on_epoch)
        rebuild: list[float] = []
        calls: list[float] = []
        cpu: list[float] = []
        with collector_paused():
            try:
                await emu.start(concurrency=32, sessions_after=True)
                if not await emu.wait_all_have(lambda e: len(e.members) == n, timeout=60 + n / 20):
                    raise RuntimeError(f"the first epoch with {n} members did not reach every replica")
                first = emu.replicas[0].epoch
                assert first is not None
                await asyncio.to_thread(emu_lanes.finished, first.number, n, 120.0)
                for i in range(deaths):
                    # The victim hosts lane 0 (with members hosting: its lanes move to their next hosts).
                    alive = emu.alive()
                    now = alive[0].epoch
                    assert now is not None
                    host = lane_hosts.host(now.members, 0)
                    victim = next(r for r in alive if r.replica_id == host)
                    reporter = next(r for r in alive if r is not victim)
                    before = now.number
                    calls0, cpu0 = await asyncio.to_thread(_rendezvous_calls, http, secret), cpu_seconds(proc.pid)
                    killed_at = time.time()
                    emu_lanes.kill(victim.replica_id)
                    await emu.kill(victim)
                    await emu.report(reporter, victim)
                    gone = victim.replica_id

                    def without(e: EpochView, b: int = before, g: str = gone) -> bool:
                        return e.number > b and e.member(g) is None

                    if not await emu.wait_all_have(without, timeout=10 * interval + 5 + n / 200):
                        raise RuntimeError(f"death {i}: the new epoch did not reach every member")
                    epoch = reporter.epoch
                    assert epoch is not None
                    done = await asyncio.to_thread(emu_lanes.finished, epoch.number, len(epoch.members), 120.0)
                    rebuild += [t - killed_at for t in done.values()]
                    calls.append(await asyncio.to_thread(_rendezvous_calls, http, secret) - calls0)
                    cpu.append(cpu_seconds(proc.pid) - cpu0)
                    # Back as a new incarnation, its lanes rebuilt with it (the members learn the hosts again).
                    back = await emu.restart(victim)
                    rid = back.replica_id
                    inc = back.client.incarnation
                    def with_it(e: EpochView, r: str = rid, c: str = inc) -> bool:
                        x = e.member(r)
                        return x is not None and x.incarnation == c

                    if not await emu.wait_all_have(with_it, timeout=10 * interval + 10 + n / 100):
                        raise RuntimeError(f"rejoin {i}: no epoch with {rid} reached every member")
                    joined = back.epoch
                    assert joined is not None
                    await asyncio.to_thread(emu_lanes.finished, joined.data_plane, len(joined.members), 120.0)
            finally:
                await emu.close()
                await asyncio.to_thread(emu_lanes.close)
                stop_process(proc)
    per_call = (sum(cpu) / sum(calls) * 1e6) if sum(calls) else None
    projected = statistics.mean(calls) / lanes * ranks if calls else 0.0
    return LaneRebuild(
        rendezvous_on=rendezvous_on, lanes_total=ranks, lanes_sampled=lanes, members_per_lane=n - 1,
        backend=backend, deaths=deaths,
        lane_rebuild_p50_s=round(pct(rebuild, 0.5), 4), lane_rebuild_p99_s=round(pct(rebuild, 0.99), 4),
        lighthouse_calls_per_change=round(statistics.mean(calls), 1) if calls else 0.0,
        lighthouse_calls_per_change_projected=round(projected, 1),
        lighthouse_cpu_s_per_change=round(statistics.mean(cpu), 4) if cpu else 0.0,
        lighthouse_cpu_us_per_call=round(per_call, 1) if per_call is not None else None,
        lighthouse_rebuild_projected_s=round(projected * per_call / 1e6, 2) if per_call is not None else None,
        errors=emu_lanes.errors[:10])


def sample_size(n: int, ranks: int, sample_ranks: int = SAMPLE_RANKS) -> int:
    """Lanes to emulate whole for N replica groups of ``ranks`` ranks: about ``sample_ranks`` emulated ranks."""
    return max(1, min(ranks, sample_ranks // max(1, n)))


def bench_lanes(n: int, ranks: int, deaths: int = 3, lanes: int = 0, backend: str = "mesh") -> dict[str, Any]:
    """Both ways of meeting at one size, members first then the baseline, in this invocation."""
    lanes = lanes or sample_size(n, ranks)
    runs = [asyncio.run(_one(n, ranks, lanes, deaths, backend, on)) for on in ("members", "lighthouse")]
    return {"replicas": n, "ranks_per_group": ranks, "lane_rebuild_p99_s": runs[0].lane_rebuild_p99_s,
            "baseline_lane_rebuild_p99_s": runs[1].lane_rebuild_p99_s,
            "members": runs[0].to_json(), "lighthouse": runs[1].to_json(),
            "loadavg_1min": round(os.getloadavg()[0], 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
