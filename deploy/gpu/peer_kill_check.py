"""A lane's NCCL group against a peer process SIGKILLed mid-collective, on one GPU (deploy/gpu/nccl_check.sh,
one-GPU mode; docs/gpu.md §4 "The watchdog").

Three processes on ``cuda:0``, each a host of its own to NCCL (``NCCL_HOSTID``, set by nccl_check.sh): the
``survivor`` (rank 0) and the ``victim`` (rank 1) build a lane's group the way FTAR does (torchft's NCCL group,
``ftar.group.configure_with_store``, the real ``EpochGroup``, its watcher and ``Reaper``) and exchange once; then the
survivor starts an all-reduce, the victim SIGKILLs itself before joining it, and the survivor waits as a lane does
(``ftar.completion.outcome`` with FTAR's deadline), aborts, stays alive for ``--live`` seconds, and rebuilds a group
with the ``rejoiner`` (a new rank 1), exchanging once more. Each process also holds a one-rank NCCL group of its
own, built first, as a trainer's replica group is.

``--settings fixed`` is what fthsdp ships (``ftar.nccl_env``: the process settings once the trainer's group exists,
the lane settings while a lane's group is built); ``--settings shipped`` is c10d's defaults, the control. Prints one
JSON line per event (``PEER_KILL {...}``). Without a role it runs the three and prints the verdict (one JSON
object; exit 1 when the survivor under ``fixed`` did not live, detect the failure and rebuild; the ``shipped``
control only reports). ``--backend gloo`` runs the same steps on the CPU (tests/integration/test_gpu_checks.py).

    python deploy/gpu/peer_kill_check.py --settings fixed|shipped [--live 20] [--backend nccl|gloo]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from ftar import nccl_env
from ftar.completion import Outcome, outcome
from ftar.group import EpochGroup, Reaper, configure_with_store
from ftar.packing import Staging
from ftar.rules import Verdict
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember

DEADLINE_S = 3.5
"""FTAR's: the collective timeout (3 s here) plus its 0.5 s slack."""
T0 = time.monotonic()


def say(event: str, **fields: Any) -> None:
    print("PEER_KILL " + json.dumps({"event": event, "t": round(time.monotonic() - T0, 3), **fields}, default=str),
          flush=True)


def lane_group(store: dist.Store, number: int, rank: int, settings: str, backend: str) -> EpochGroup:
    """Epoch ``number``'s group of two, built as FTAR builds it."""
    ids = ("survivor", "peer")
    view = EpochView("check", number, tuple(EpochMember(r, "i", ACTIVE, 1, Endpoints()) for r in ids), "", 0.0, "check")
    epoch_store = dist.PrefixStore(f"epoch{number}", store)
    pg_class = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
    pg = pg_class(timeout=timedelta(seconds=10))  # FTAR's connect timeout
    # configure_with_store builds it under the lane settings; the control (c10d's defaults) empties them first.
    with _without_lane_settings() if settings == "shipped" else contextlib.nullcontext():
        configure_with_store(pg, dist.PrefixStore("pg", epoch_store), ids[rank], rank, 2)
    return EpochGroup(view, rank, epoch_store, pg, Staging(device_of(backend)), backend)


def device_of(backend: str) -> torch.device:
    return torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")


@contextlib.contextmanager
def _without_lane_settings() -> Any:
    """The shipped settings' control: ``nccl_env.lane_settings`` changes nothing."""
    saved = nccl_env.LANE.copy()
    nccl_env.LANE.clear()
    try:
        yield
    finally:
        nccl_env.LANE.update(saved)


def exchange(group: EpochGroup, reaper: Reaper, value: float) -> dict[str, Any]:
    """One SUM all-reduce of a 4 MiB tensor of ``value``, waited for as a lane waits."""
    x = torch.full((1 << 20,), value, device=group.staging.device)
    t0 = time.monotonic()
    work = group.allreduce(x, dist.ReduceOp.SUM, 3.0)
    watcher = group.watch(work, threading.Event())
    while True:
        verdict = Verdict.DEADLINE if time.monotonic() - t0 > DEADLINE_S else Verdict.WAIT
        decided = outcome(watcher.poll(), verdict)
        if decided is Outcome.DONE:
            return {"outcome": "done", "s": round(time.monotonic() - t0, 3), "value": float(x[0].item())}
        if decided is not Outcome.WAIT:
            group.abort(reaper)
            return {"outcome": decided.value, "s": round(time.monotonic() - t0, 3), "why": watcher.error()}
        watcher.pause(0.01)


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("PEER_KILL ")]


def verdict(settings: str, live: float, statuses: dict[str, int | None],
            survivor: list[dict[str, Any]]) -> dict[str, Any]:
    """Did the survivor live through its peer's death, find it, and rebuild? (Pure: from its events and statuses.)"""
    by = {e["event"]: e for e in survivor}
    found = by.get("peer_failed", {})
    r: dict[str, Any] = {
        "settings": settings, "statuses": statuses,
        "warm": by.get("warm", {}).get("value") == 3.0,
        "failure_found": found.get("outcome"), "failure_found_after_s": found.get("s"),
        "alive_s": max([e["s"] for e in survivor if e["event"] == "alive"], default=0),
        "rebuilt": by.get("rebuilt", {}).get("value") == 3.0 and statuses.get("rejoiner") == 0,
        "survivor_exit": statuses.get("survivor"), "last_event": survivor[-1] if survivor else None}
    r["survived"] = statuses.get("survivor") == 0 and "end" in by and r["alive_s"] >= int(live) // 5 * 5
    r["ok"] = bool(r["warm"] and r["failure_found"] in ("failed", "abort_deadline") and r["survived"]
                   and r["rebuilt"] and statuses.get("victim") == -signal.SIGKILL)
    return r


def orchestrate(settings: str, live: float, backend: str) -> dict[str, Any]:
    """The three roles as processes (the victim SIGKILLs itself; the rejoiner starts once it is gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="fthsdp-peer-kill-")
    out: dict[str, str] = {}
    statuses: dict[str, int | None] = {}

    def start(role: str) -> subprocess.Popen[str]:
        env = {**os.environ, "NCCL_HOSTID": f"fthsdp-peer-kill-{role}"}  # a host of its own to NCCL
        return subprocess.Popen([sys.executable, __file__, role, "--port", str(port), "--dir", workdir, "--settings",
                                 settings, "--live", str(live), "--backend", backend], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(role: str, proc: subprocess.Popen[str], timeout: float) -> None:
        try:
            out[role] = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out[role] = proc.communicate()[0]
        statuses[role] = proc.returncode

    survivor = start("survivor")
    finish("victim", start("victim"), 120)
    finish("rejoiner", start("rejoiner"), live + 120)
    finish("survivor", survivor, 60)
    for role, text in out.items():
        pathlib.Path(workdir, f"{role}.log").write_text(text)
    r = verdict(settings, live, statuses, events(out["survivor"]))
    r["logs"] = workdir
    return r


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", nargs="?", choices=("survivor", "victim", "rejoiner"))
    p.add_argument("--port", type=int)
    p.add_argument("--dir")
    p.add_argument("--settings", choices=("fixed", "shipped"), required=True)
    p.add_argument("--live", type=float, default=20.0)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    a = p.parse_args()
    if a.role is None:
        r = orchestrate(a.settings, a.live, a.backend)
        print(json.dumps(r), flush=True)
        return 0 if r["ok"] or a.settings == "shipped" else 1
    rank = 0 if a.role == "survivor" else 1
    device = device_of(a.backend)
    if a.backend == "nccl":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))  # a lane's stream of its own
    # The trainer's replica group first (one rank), as a trainer builds it before the runtime starts.
    dist.init_process_group(a.backend, store=dist.FileStore(os.path.join(a.dir, f"replica-{a.role}"), 1), rank=0,
                            world_size=1, device_id=device if a.backend == "nccl" else None)
    dist.all_reduce(torch.ones(1, device=device))
    if a.settings == "fixed":
        nccl_env.prepare_process()  # what the runtime does before it builds anything
    say("start", role=a.role, settings=a.settings, env={k: v for k, v in os.environ.items() if "NCCL" in k})
    store = dist.TCPStore("127.0.0.1", a.port, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    reaper = Reaper(0, device if a.backend == "nccl" else None)
    if a.role == "rejoiner":
        group = lane_group(store, 2, rank, a.settings, a.backend)
        say("rejoined", **exchange(group, reaper, 2.0))
        return 0
    group = lane_group(store, 1, rank, a.settings, a.backend)
    say("warm", **exchange(group, reaper, float(rank + 1)))  # 1 + 2 = 3 on both
    if a.role == "victim":
        store.wait(["issued"])
        time.sleep(0.5)
        say("sigkill")
        os.kill(os.getpid(), signal.SIGKILL)
    store.set("issued", "1")
    say("peer_failed", **exchange(group, reaper, 1.0))  # the victim never joins: failed, or at the deadline
    for i in range(int(a.live)):
        time.sleep(1.0)
        if (i + 1) % 5 == 0:
            say("alive", s=i + 1)
    group = lane_group(store, 2, rank, a.settings, a.backend)  # the rejoiner comes: a new group, the same lane stream
    say("rebuilt", **exchange(group, reaper, 1.0))  # 1 + 2 = 3
    reaper.join(30.0)
    say("end")
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # NCCL's teardown of groups whose peer died can hang
