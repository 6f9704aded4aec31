"""``fthsdp bench ftar``: FTAR against a plain ``torch.distributed.all_reduce`` of the same tensor on the same
backend, in the same run and the same processes; then the rebuild time of a new epoch and the stall survivors
see when one member is SIGKILLed mid-exchange.

The controller (``bench_ftar``) runs a lighthouse in-process and ``members`` member processes
(``python -m fthsdp.bench.ftar --member ...``), which report through JSON-lines files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from fthsdp.bench.results import FtarResult

ROUNDS = 3  # baseline/FTAR alternations, so drift hits both alike


# --- member ---------------------------------------------------------------------------------------------------


def _member(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ftar import EpochFeed, FTARConfig, LaneEngine, LighthouseMembership
    from ftar.store import on_lighthouse, open_store
    from lighthouse.client import LighthouseClient

    torch.set_num_threads(1)
    out = open(a.out, "a", buffering=1)  # noqa: SIM115 (written to until the process exits)

    def emit(**kv: Any) -> None:
        out.write(json.dumps(kv) + "\n")

    rid = f"m{a.index}"
    feed = EpochFeed()
    client = LighthouseClient(a.lighthouse, "default", rid, on_epoch=feed.publish)
    client.start()
    epoch = client.wait_epoch(0, 60)
    assert epoch is not None
    membership = LighthouseMembership(client, feed)
    # The baseline: a plain Gloo group of the same processes, through the same (authenticated) rendezvous store.
    base = open_store(on_lighthouse(epoch.rendezvous), membership.store_target(), timedelta(seconds=60))
    store = dist.PrefixStore("baseline", base)
    dist.init_process_group("gloo", store=store, rank=a.index, world_size=a.members, timeout=timedelta(seconds=60))
    engine = LaneEngine(membership, 0,
                        FTARConfig(timeout_s=a.timeout, connect_timeout_s=30, epoch_wait_s=30))
    numel = int(a.mb * 2**20 // 4)
    x = torch.full((numel,), float(a.index + 1))
    engine.allreduce([x], tag=0).wait(120)  # first exchange builds the data plane
    dist.all_reduce(x.clone())
    emit(event="rebuild", seconds=engine.last_rebuild_s)
    # Same work on both sides. "sum": in-place all_reduce vs FTAR reducing in place (keep_inputs=False: after a
    # failure the caller recomputes its inputs). "avg": all_reduce then divide vs FTAR's default mode, which keeps
    # the inputs intact on a private buffer so it can redo the exchange itself after a failure.
    times: dict[str, list[float]] = {"base_sum": [], "ftar_sum": [], "base_avg": [], "ftar_avg": []}
    step = 1
    y, g = x.clone(), x.clone()

    def timed(name: str, fn: Any) -> None:
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)

    def average() -> None:
        dist.all_reduce(y)
        y.div_(a.members)

    for _ in range(ROUNDS):
        for _ in range(a.iters):
            timed("base_sum", lambda: dist.all_reduce(y))
            timed("ftar_sum", lambda tag=step: engine.allreduce([g], op="sum", tag=tag, inplace=True,
                                                                keep_inputs=False).wait(120))
            step += 1
            timed("base_avg", average)
            timed("ftar_avg", lambda tag=step: engine.allreduce([g], tag=tag, inplace=True).wait(120))
            step += 1
            y.fill_(1.0)
            g.fill_(1.0)
    emit(event="throughput", **{k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()
    # Kill phase: keep exchanging; the controller SIGKILLs one member mid-exchange.
    for i in range(a.kill_iters):
        emit(event="entering", i=i)
        t = time.perf_counter()
        r = engine.allreduce([g], tag=step, inplace=True).wait(120)
        emit(event="exchange", i=i, seconds=time.perf_counter() - t, epoch=r.epoch, contributors=r.contributors,
             attempts=r.attempts, rebuild_s=engine.last_rebuild_s)
        step += 1
    engine.close()
    membership.close()
    client.close()
    emit(event="done")


# --- controller -----------------------------------------------------------------------------------------------


def _read(path: pathlib.Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    except FileNotFoundError:
        return []


def _wait(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)  # polling a condition with a deadline
    raise TimeoutError(f"timed out waiting for {what}")


def bench_ftar(members: int = 4, mb: float = 64.0, iters: int = 3, kill_iters: int = 6,
               timeout_s: float = 5.0) -> FtarResult:
    from lighthouse.config import LighthouseConfig
    from lighthouse.membership import Policy
    from lighthouse.server.app import Lighthouse

    if members < 2:
        raise ValueError("need at least 2 members")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    policy = Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0, confirm_age_s=0.3,
                    expected_replicas=members)
    lh = Lighthouse(LighthouseConfig(bind="127.0.0.1:0", http=None, policy=policy, tick_s=0.02))
    asyncio.run_coroutine_threadsafe(lh.start(), loop).result(60)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-ftar-") as tmp:
        outs = [pathlib.Path(tmp) / f"m{i}.jsonl" for i in range(members)]
        try:
            for i in range(members):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fthsdp.bench.ftar", "--member", "--lighthouse", f"127.0.0.1:{lh.port}",
                     "--index", str(i), "--members", str(members), "--mb", str(mb), "--iters", str(iters),
                     "--kill-iters", str(kill_iters), "--timeout", str(timeout_s), "--out", str(outs[i])],
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            victim = members - 1
            _wait(lambda: any(x.get("event") == "entering" and x["i"] == 2 for x in _read(outs[victim])), 900,
                  "the kill phase")
            time.sleep(0.05)  # let the exchange get under way: the kill must land mid-exchange
            procs[victim].send_signal(signal.SIGKILL)
            for p in procs[:victim]:
                if p.wait(300) != 0:
                    raise RuntimeError(f"member exited with {p.returncode}")
            rows = [_read(o) for o in outs[:victim]]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            asyncio.run_coroutine_threadsafe(lh.stop(0.1), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
    thr = [next(x for x in r if x.get("event") == "throughput") for r in rows]
    med = {k: statistics.median(x[k] for x in thr) for k in ("base_sum", "ftar_sum", "base_avg", "ftar_avg")}
    exchanges = [[x for x in r if x.get("event") == "exchange"] for r in rows]
    normal = statistics.median(x["seconds"] for ex in exchanges for x in ex if x["attempts"] == 1 and x["i"] < 2)
    killed = [max(ex[2:], key=lambda x: x["seconds"]) for ex in exchanges]
    stall = statistics.median(x["seconds"] for x in killed) - normal
    after = [ex[-1] for ex in exchanges]
    size = mb * 2**20
    return FtarResult(
        members=members,
        mb=mb,
        baseline_allreduce_s=round(med["base_sum"], 4),
        ftar_allreduce_s=round(med["ftar_sum"], 4),
        baseline_gbps=round(size * 8 / med["base_sum"] / 1e9, 3),
        ftar_gbps=round(size * 8 / med["ftar_sum"] / 1e9, 3),
        throughput_ratio=round(med["base_sum"] / med["ftar_sum"], 3),
        baseline_average_s=round(med["base_avg"], 4),
        ftar_average_keep_inputs_s=round(med["ftar_avg"], 4),
        average_keep_inputs_ratio=round(med["base_avg"] / med["ftar_avg"], 3),
        rebuild_s=round(statistics.median(x["rebuild_s"] for x in after), 4),
        first_build_s=round(statistics.median(next(x for x in r if x.get("event") == "rebuild")["seconds"]
                                                 for r in rows), 4),
        kill_stall_s=round(stall, 3),
        normal_exchange_s=round(normal, 4),
        contributors_after_kill=after[0]["contributors"],
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--member", action="store_true")
    p.add_argument("--lighthouse")
    p.add_argument("--index", type=int)
    p.add_argument("--members", type=int)
    p.add_argument("--mb", type=float)
    p.add_argument("--iters", type=int)
    p.add_argument("--kill-iters", type=int)
    p.add_argument("--timeout", type=float)
    p.add_argument("--out")
    a = p.parse_args()
    _member(a)


if __name__ == "__main__":
    main()
