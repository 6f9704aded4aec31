"""``fthsdp bench lighthouse``: a real lighthouse in its own process, loaded by N emulated replicas.

Reports heartbeat throughput (accepted per second, against the N/interval offered), the lighthouse's CPU use,
and for a series of deaths: detection (kill -> epoch formed), push (epoch formed -> received by each member,
p50/p99 over every member of every death) and the whole delay (kill -> last member has it).
"""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Any

from lighthouse.emulate import Emulator
from lighthouse.process import start_lighthouse_process


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _bench_one(n: int, deaths: int, window_s: float, interval: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-lh-") as tmp:
        proc, addr, _ = start_lighthouse_process(
            ["--heartbeat-interval", str(interval), "--heartbeat-timeout", str(5 * interval),
             "--confirm-age", str(interval), "--expected-replicas", str(n), "--no-rendezvous"],
            pathlib.Path(tmp))
        emu = Emulator(addr, n, prefix="bench")
        try:
            t0 = time.perf_counter()
            await emu.start()
            if not await emu.wait_all_have(lambda e: len(e.members) == n, timeout=120):
                raise RuntimeError(f"the first epoch with {n} members did not reach every replica")
            bootstrap_s = time.perf_counter() - t0
            # The emulator holds N replicas' clients in one heap, so its full garbage collections pause every
            # emulated replica at once (hundreds of ms at N=1000), which real replicas, each in its own process,
            # do not suffer. Exclude what exists after bootstrap from collection so the measured push delays are
            # the lighthouse's, not the emulator's.
            gc.collect()
            gc.freeze()
            await asyncio.sleep(interval)  # settle one heartbeat period before measuring
            hb0, cpu0, w0 = sum(r.client.heartbeats for r in emu.replicas), _cpu_seconds(proc.pid), time.perf_counter()
            await asyncio.sleep(window_s)  # the measuring window
            hb1, cpu1, w1 = sum(r.client.heartbeats for r in emu.replicas), _cpu_seconds(proc.pid), time.perf_counter()
            push, detect, total = [], [], []
            for i in range(deaths):
                alive = emu.alive()
                victim, reporter = alive[-1], alive[0]
                before = reporter.epoch.number if reporter.epoch else 0
                killed_at = time.time()
                await emu.kill(victim)
                await emu.report(reporter, victim)
                ok = await emu.wait_all_have(lambda e: e.number > before and e.member(victim.replica_id) is None,
                                             timeout=10 * interval + 5)
                if not ok:
                    raise RuntimeError(f"death {i}: the new epoch did not reach every member")
                epoch = reporter.epoch
                assert epoch is not None
                got = [r.received[epoch.number] for r in emu.alive()]
                push += [g - epoch.created_unix for g in got]
                detect.append(epoch.created_unix - killed_at)
                total.append(max(got) - killed_at)
            return {
                "replicas": n,
                "heartbeat_interval_s": interval,
                "bootstrap_s": round(bootstrap_s, 3),
                "heartbeats_per_s": round((hb1 - hb0) / (w1 - w0), 1),
                "heartbeats_offered_per_s": round(n / interval, 1),
                "heartbeat_ratio": round((hb1 - hb0) / (w1 - w0) / (n / interval), 3),
                "lighthouse_cpu_pct": round(100 * (cpu1 - cpu0) / (w1 - w0), 1),
                "deaths": deaths,
                "detect_p50_s": round(statistics.median(detect), 4),
                "push_p50_s": round(_pct(push, 0.5), 4),
                "push_p99_s": round(_pct(push, 0.99), 4),
                "death_to_all_p50_s": round(_pct(total, 0.5), 4),
                "death_to_all_p99_s": round(_pct(total, 0.99), 4),
            }
        finally:
            gc.unfreeze()
            await emu.close()
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_lighthouse(replicas: list[int], deaths: int = 5, window_s: float = 5.0,
                     interval: float = 1.0) -> dict[str, Any]:
    results = [asyncio.run(_bench_one(n, deaths, window_s, interval)) for n in replicas]
    return {"benchmark": "lighthouse", "results": results}
