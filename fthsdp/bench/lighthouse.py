"""``fthsdp bench lighthouse``: a real lighthouse in its own process, loaded by N emulated replicas.

Reports heartbeat throughput (accepted per second, against the N/interval offered), the lighthouse's and the
emulator's CPU use (both share this machine's cores: when the emulator saturates, fewer heartbeats are offered),
the size of one epoch message, and for a series of deaths: detection (kill -> epoch formed), push (epoch formed ->
received by each member, p50/p99 over every member of every death) and the whole delay (kill -> last member has
it); then each dead replica comes back as a new incarnation (register, join, turn active: two epochs) and the
delay from its registration until every member holds an epoch with it active; and the lighthouse's CPU over the
deaths and rejoins.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import pathlib
import statistics
import tempfile
import time
import urllib.request
from typing import Any

from fthsdp.bench.emulate import Emulator, collector_paused
from fthsdp.bench.procstat import cpu_seconds as _cpu_seconds
from fthsdp.bench.procstat import pct as _pct
from fthsdp.bench.results import LighthouseResult, LighthouseRun
from fthsdp.launch.lighthouse_process import start_lighthouse_process
from fthsdp.launch.procutil import stop_process

log = logging.getLogger("fthsdp.bench")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _established(port: int) -> int:
    """TCP connections established to ``port`` on this host (the lighthouse's end of each, from /proc)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def _streams(http: str) -> int:
    """Sessions and watch streams the lighthouse holds open (its /metrics)."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as resp:  # noqa: S310 (loopback)
        text = resp.read().decode()
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(("fthsdp_lighthouse_sessions ", "fthsdp_lighthouse_watchers "))))


async def _bench_one(n: int, deaths: int, window_s: float, interval: float, rejoins: bool = True,
                     ranks: int = 8) -> LighthouseRun:
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-lh-") as tmp:
        # The heartbeat timeout also covers the bootstrap: the emulator registers everyone before any heartbeat
        # (registering thousands one by one keeps the lighthouse busy for seconds on 2 cores). Deaths are
        # confirmed by evidence: the killed group's session closes, a peer reports it.
        timeout = max(5 * interval, 30 + n / 100)
        proc, addr, http = start_lighthouse_process(
            ["--heartbeat-interval", str(interval), "--heartbeat-timeout", str(timeout),
             "--confirm-age", str(interval), "--expected-replicas", str(n), "--max-members", str(max(n, 4096)),
             "--no-rendezvous"],
            pathlib.Path(tmp))
        port = int(addr.rsplit(":", 1)[1])
        emu = Emulator(addr, n, prefix="bench", rpc_timeout_s=max(5.0, n / 250), ranks=ranks)
        # The emulator holds N replicas' clients in one heap, so its garbage collections pause every emulated
        # replica at once (up to a second at N=10,000), which real replicas, each in its own process, do not
        # suffer: its collector stays off while it measures (``collector_paused``), so the delays are the
        # lighthouse's, not the emulator's.
        with collector_paused():
            try:
                t0 = time.perf_counter()
                await emu.start(concurrency=32, sessions_after=True)
                if not await emu.wait_all_have(lambda e: len(e.members) == n, timeout=60 + n / 20):
                    raise RuntimeError(f"the first epoch with {n} members did not reach every replica")
                bootstrap_s = time.perf_counter() - t0
                gc.collect()  # the bootstrap's garbage, before measuring (an explicit collection runs while paused)
                gc.freeze()
                await asyncio.sleep(interval)  # settle one heartbeat period before measuring
                hb0 = sum(r.client.heartbeats for r in emu.replicas)
                cpu0, w0 = _cpu_seconds(proc.pid), time.perf_counter()
                own0 = _own_cpu_seconds()
                await asyncio.sleep(max(window_s, 2 * interval))  # the measuring window: two heartbeat periods or more
                hb1 = sum(r.client.heartbeats for r in emu.replicas)
                cpu1, w1 = _cpu_seconds(proc.pid), time.perf_counter()
                own1 = _own_cpu_seconds()
                connections, streams = _established(port), await asyncio.to_thread(_streams, http)
                status = await emu.replicas[0].client.status()
                epoch_bytes = status.epoch.ByteSize()
                push, detect, total, change_bytes = [], [], [], []
                churn_cpu0, churn_w0, churn_own0 = _cpu_seconds(proc.pid), time.perf_counter(), _own_cpu_seconds()
                victims = []
                for i in range(deaths):
                    alive = emu.alive()
                    victim, reporter = alive[-1], alive[0]
                    before = reporter.epoch.number if reporter.epoch else 0
                    bytes_before = {id(r): r.client.update_bytes for r in alive}
                    killed_at = time.time()
                    await emu.kill(victim)
                    await emu.report(reporter, victim)
                    gone = victim.replica_id

                    def without_victim(e: Any, before: int = before, gone: str = gone) -> bool:
                        return e.number > before and e.member(gone) is None

                    ok = await emu.wait_all_have(without_victim, timeout=10 * interval + 5 + n / 200)
                    if not ok:
                        raise RuntimeError(f"death {i}: the new epoch did not reach every member")
                    epoch = reporter.epoch
                    assert epoch is not None
                    got = [r.received[epoch.number] for r in emu.alive()]
                    push += [g - epoch.created_unix for g in got]
                    detect.append(epoch.created_unix - killed_at)
                    total.append(max(got) - killed_at)
                    change_bytes += [r.client.update_bytes - bytes_before[id(r)] for r in emu.alive()]
                    victims.append(victim)
                    log.info("bench lighthouse replicas=%d death=%d detect=%.4fs push p50=%.4fs max=%.4fs all=%.4fs", n,
                             i, detect[-1], _pct([g - epoch.created_unix for g in got], 0.5),
                             max(got) - epoch.created_unix, total[-1])
                rejoin_total, rejoin_push = [], []
                if rejoins:
                    for i, dead in enumerate(victims):
                        t_reg = time.time()
                        r = await emu.restart(dead)
                        rid, inc = r.replica_id, r.client.incarnation

                        def active(e: Any, rid: str = rid, inc: str = inc) -> bool:
                            x = e.member(rid)
                            return x is not None and x.incarnation == inc and x.role == "active"

                        if not await emu.wait_all_have(active, timeout=10 * interval + 10 + n / 100):
                            raise RuntimeError(f"rejoin {i}: the epoch with {rid} active did not reach every member")
                        epoch = r.epoch
                        assert epoch is not None
                        got = [x.received[epoch.number] for x in emu.alive()]
                        rejoin_push += [g - epoch.created_unix for g in got]
                        rejoin_total.append(max(got) - t_reg)
                churn_cpu1, churn_w1, churn_own1 = _cpu_seconds(proc.pid), time.perf_counter(), _own_cpu_seconds()
                errors: collections.Counter[str] = collections.Counter()
                for r in emu.replicas:
                    errors.update(r.client.errors)
                return LighthouseRun(
                    replicas=n,
                    ranks_per_replica=ranks,
                    heartbeat_interval_s=interval,
                    heartbeat_timeout_s=timeout,
                    bootstrap_s=round(bootstrap_s, 3),
                    epoch_message_bytes=epoch_bytes,
                    epoch_change_bytes=round(statistics.median(change_bytes)) if change_bytes else 0,
                    heartbeats_per_s=round((hb1 - hb0) / (w1 - w0), 1),
                    heartbeats_offered_per_s=round(n / interval, 1),
                    heartbeat_ratio=round((hb1 - hb0) / (w1 - w0) / (n / interval), 3),
                    lighthouse_cpu_pct=round(100 * (cpu1 - cpu0) / (w1 - w0), 1),
                    emulator_cpu_pct=round(100 * (own1 - own0) / (w1 - w0), 1),
                    lighthouse_connections=connections,
                    lighthouse_streams=streams,
                    deaths=deaths,
                    detect_p50_s=round(statistics.median(detect), 4),
                    detect_p99_s=round(_pct(detect, 0.99), 4),
                    push_p50_s=round(_pct(push, 0.5), 4),
                    push_p99_s=round(_pct(push, 0.99), 4),
                    death_to_all_p50_s=round(_pct(total, 0.5), 4),
                    death_to_all_p99_s=round(_pct(total, 0.99), 4),
                    rejoins=len(rejoin_total),
                    rejoin_to_all_p50_s=round(_pct(rejoin_total, 0.5), 4) if rejoin_total else None,
                    rejoin_to_all_p99_s=round(_pct(rejoin_total, 0.99), 4) if rejoin_total else None,
                    rejoin_push_p50_s=round(_pct(rejoin_push, 0.5), 4) if rejoin_push else None,
                    rejoin_push_p99_s=round(_pct(rejoin_push, 0.99), 4) if rejoin_push else None,
                    lighthouse_cpu_pct_churn=round(100 * (churn_cpu1 - churn_cpu0) / (churn_w1 - churn_w0), 1),
                    emulator_cpu_pct_churn=round(100 * (churn_own1 - churn_own0) / (churn_w1 - churn_w0), 1),
                    churn_s=round(churn_w1 - churn_w0, 2),
                    cancelled_calls=errors["CANCELLED"],
                    call_errors=dict(sorted(errors.items())),
                    healthy_evicted=emu.evicted,
                    loadavg_1min=round(os.getloadavg()[0], 2),
                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                )
            finally:
                gc.unfreeze()
                await emu.close()
                stop_process(proc)


HEARTBEAT_BUDGET_PER_S = 1000.0
"""Heartbeats per second the automatic interval offers at most: one lighthouse on this machine's 2 shared cores
(with the emulator beside it) keeps up with about 1,500 (see ``saturation``)."""


def auto_interval(n: int, budget: float = HEARTBEAT_BUDGET_PER_S) -> float:
    """The heartbeat interval that keeps N replicas' heartbeats within ``budget`` per second (at least 1 s)."""
    return max(1.0, n / budget)


def bench_lighthouse(replicas: list[int], deaths: int = 5, window_s: float = 5.0,
                     interval: float = 1.0, rejoins: bool = True, ranks: int = 8,
                     vs_torchft: bool = False, lanes: int | None = 0, lane_backend: str = "mesh",
                     lane_deaths: int = 3) -> LighthouseResult:
    """``interval`` 0: automatic (``auto_interval``) per replica count; ``ranks`` per emulated replica group;
    ``vs_torchft``: then torchft's lighthouse at each size, with heartbeats at the same interval; ``lanes``: lanes
    emulated whole at each size for the lane rebuild after a death (``fthsdp.bench.lane_rebuild``; 0: about 240
    emulated ranks' worth; None: no lane part)."""
    from fthsdp.bench.lane_rebuild import bench_lanes

    results = [asyncio.run(_bench_one(n, deaths, window_s, interval or auto_interval(n), rejoins, ranks))
               for n in replicas]
    lane_runs = None if lanes is None else [bench_lanes(n, ranks, lane_deaths, lanes, lane_backend)
                                            for n in replicas]
    torchft = None
    if vs_torchft:
        from fthsdp.bench.baselines.torchft_lighthouse import bench_torchft_lighthouse

        torchft = [bench_torchft_lighthouse(n, interval or auto_interval(n)) for n in replicas]
    return LighthouseResult(cpus=os.cpu_count(), sizes=results, torchft=torchft, lanes=lane_runs)


async def _saturation_one(n: int, interval: float, window_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-lh-") as tmp:
        proc, addr, _ = start_lighthouse_process(
            ["--heartbeat-interval", str(interval), "--heartbeat-timeout", str(max(5.0, 5 * interval)),
             "--expected-replicas", str(n), "--max-members", str(max(n, 4096)), "--no-rendezvous"], pathlib.Path(tmp))
        emu = Emulator(addr, n, prefix="sat", rpc_timeout_s=10.0)
        try:
            await emu.start()
            if not await emu.wait_all_have(lambda e: len(e.members) == n, timeout=60 + n / 20):
                raise RuntimeError(f"the first epoch with {n} members did not reach every replica")
            gc.collect()
            gc.freeze()
            await asyncio.sleep(max(1.0, interval))
            hb0, cpu0, own0, w0 = (sum(r.client.heartbeats for r in emu.replicas), _cpu_seconds(proc.pid),
                                   _own_cpu_seconds(), time.perf_counter())
            await asyncio.sleep(window_s)  # the measuring window
            hb1, cpu1, own1, w1 = (sum(r.client.heartbeats for r in emu.replicas), _cpu_seconds(proc.pid),
                                   _own_cpu_seconds(), time.perf_counter())
            rate = (hb1 - hb0) / (w1 - w0)
            return {"replicas": n, "heartbeat_interval_s": interval, "offered_per_s": round(n / interval, 1),
                    "accepted_per_s": round(rate, 1), "ratio": round(rate * interval / n, 3),
                    "lighthouse_cpu_pct": round(100 * (cpu1 - cpu0) / (w1 - w0), 1),
                    "emulator_cpu_pct": round(100 * (own1 - own0) / (w1 - w0), 1),
                    "lighthouse_cpu_us_per_heartbeat": round(1e6 * (cpu1 - cpu0) / max(1, hb1 - hb0), 1)}
        finally:
            gc.unfreeze()
            await emu.close()
            stop_process(proc)


def saturation(n: int = 1000, intervals: tuple[float, ...] = (2.0, 1.0, 0.5, 0.33, 0.25),
               window_s: float = 5.0) -> dict[str, Any]:
    """Offer more and more heartbeats per second to one lighthouse (N replicas, shorter and shorter intervals) and
    report how many it accepts and the CPU it takes: where accepted falls behind offered, it is saturated."""
    return {"benchmark": "lighthouse_saturation", "cpus": os.cpu_count(),
            "results": [asyncio.run(_saturation_one(n, i, window_s)) for i in intervals]}
