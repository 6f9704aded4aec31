"""``fthsdp demo``: the control plane end to end on loopback, with nothing to install or start by hand.

Starts a real lighthouse process, runs emulated replicas against it, kills one (it stops heartbeating, and a
peer reports it, as FTAR would), shows the epoch that drops it being pushed to every survivor, then restarts it
and shows it rejoin (joining, then active). The training demo (FSDP2 replicas under torchrun) replaces this
once the runtime exists.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import tempfile
import time
import urllib.request

from fthsdp.procutil import stop_process
from lighthouse import membership as m
from lighthouse.bench import start_lighthouse_process
from lighthouse.client import AsyncLighthouseClient
from lighthouse.emulate import EmulatedReplica, Emulator
from lighthouse.wire import EpochView


def _table(http: str) -> str:
    with urllib.request.urlopen(f"http://{http}/status", timeout=5) as r:
        status = json.load(r)
    lines = [f"  epoch {status['epoch']}: " + ", ".join(f"{x['replica_id']}({x['role']})"
                                                     for x in status["members"] if x["in_epoch"])]
    return "\n".join(lines)


async def _demo(replicas: int, workdir: pathlib.Path) -> None:
    proc, addr, http = start_lighthouse_process(
        ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--confirm-age", "0.4",
         "--expected-replicas", str(replicas), "--no-rendezvous"], workdir)
    print(f"lighthouse up: gRPC {addr}, status page http://{http}/ (log: {workdir}/lighthouse.log)")

    def on_epoch(r: EmulatedReplica, e: EpochView) -> None:
        if r is emu.replicas[0]:
            print(f"  pushed epoch {e.number} to {r.replica_id}: {[x.replica_id + ':' + x.role for x in e.members]}"
                  f"  ({e.reason})", flush=True)

    emu = Emulator(addr, replicas, prefix="replica", on_epoch=on_epoch)
    try:
        await emu.start()
        await emu.wait_all_have(lambda e: len(e.members) == replicas, 30)
        print(f"\n{replicas} replicas training in one epoch:\n{_table(http)}")
        victim, reporter = emu.replicas[-1], emu.replicas[0]
        before = reporter.epoch.number if reporter.epoch else 0
        print(f"\nkilling {victim.replica_id} (SIGKILL stand-in: no more heartbeats; {reporter.replica_id} "
              "reports it after a failed collective)")
        t0 = time.time()
        await emu.kill(victim)
        await emu.report(reporter, victim)
        await emu.wait_all_have(lambda e: e.number > before and e.member(victim.replica_id) is None, 10)
        got = max(r.received[max(r.received)] for r in emu.alive())
        print(f"every survivor had the new epoch {got - t0:.2f}s after the kill:\n{_table(http)}")
        print(f"\nrestarting {victim.replica_id} (new incarnation: it rejoins as joining, then turns active)")
        fresh = EmulatedReplica(AsyncLighthouseClient(addr, "default", victim.replica_id))
        emu.replicas[-1] = fresh
        reg = await fresh.client.register()
        assert reg.role == m.JOINING, reg
        emu.start_session(fresh)
        await fresh.client.ready(m.JOINING)
        await emu.wait_all_have(lambda e: (x := e.member(victim.replica_id)) is not None and x.role == m.ACTIVE, 10)
        print(f"{victim.replica_id} is back:\n{_table(http)}")
        print("\nepoch history:")
        with urllib.request.urlopen(f"http://{http}/status", timeout=5) as r:
            for e in json.load(r)["history"]:
                print(f"  {e['epoch']:>3}  {', '.join(e['members'])}  <- {e['reason']}")
    finally:
        await emu.close()
        stop_process(proc)


def run_demo(replicas: int = 4) -> None:
    with tempfile.TemporaryDirectory(prefix="fthsdp-demo-") as tmp:
        asyncio.run(_demo(replicas, pathlib.Path(tmp)))
