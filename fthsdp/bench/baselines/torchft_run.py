"""torchft on the reference workload, with the failure schedule of ``fthsdp bench recovery``: torchft's
lighthouse (the ``torchft_lighthouse`` binary) on loopback, R replica groups (one torchrun of ``ranks`` ranks
each, ``fthsdp.bench.baselines.torchft_train``: the plain module on one rank, FSDP2 inside the group on several),
a SIGKILL of group ``kill_replica`` (agent and workers) at ``kill_step``, restarted ``restart_delay_s`` later; it
heals from a live group and trains on.

torchft settings (documented in the result's ``settings``): lighthouse ``--min_replicas 2 --join_timeout_ms 1000
--heartbeat_timeout_ms 5000 --quorum_tick_ms 100`` (torchft's default join timeout is 60 s, which stalls the
survivors that long at each failure; docs/design.md §12 measured 1.25 s with 1 s and 5.3 s with the defaults it used),
Manager and Gloo timeouts 5 s (fthsdp's collective deadline), asynchronous quorum, ``init_sync=False`` (all groups
seed the same weights), ``min_replica_size=2``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from fthsdp.launch.procutil import child_env, kill_group, start_group, torchrun
from fthsdp.launch.progress import read_progress, steps_of
from fthsdp.launch.recovery_metrics import WARMUP_STEPS, Failure, recovery_metrics
from fthsdp.testing.ports import free_port, wait_port

JOIN_TIMEOUT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
QUORUM_TICK_MS = 100


@dataclass
class _Group:
    index: int
    progress: pathlib.Path
    log: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    finished: bool = False
    restart_at: float | None = None


def _lighthouse_binary() -> str:
    import sys

    exe = pathlib.Path(sys.executable).parent / "torchft_lighthouse"
    found = str(exe) if exe.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise RuntimeError("torchft_lighthouse not found (pip install torchft==0.2.0)")
    return found


def run_torchft(workdir: pathlib.Path | str, steps: int = 60, kill_step: int = 20, seed: int = 0,
                replicas: int = 3, ranks: int = 1, kill_replica: int = 1, restart_delay_s: float = 2.0,
                model: str = "reference", batch: int = 8, lr: float = 3e-4, timeout_s: float = 900.0,
                collective_timeout_s: float = 5.0, join_timeout_ms: int = JOIN_TIMEOUT_MS,
                warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Run the job to completion; return ``step_s`` (median steady step), ``stall_s`` (survivors' stall per
    failure), ``rejoin_s`` (kill -> first committed step of the restarted group), ``ett`` (effective training
    time), ``final_equal`` (every group ends with bitwise-equal parameters and optimizer state), and details."""
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    barrier = work / "barrier"
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir()
    groups = [_Group(i, work / f"replica{i}.progress.jsonl", work / f"replica{i}.log") for i in range(replicas)]
    for g in groups:
        g.progress.unlink(missing_ok=True)
    events: list[dict[str, Any]] = []
    port = free_port()
    with open(work / "lighthouse.log", "wb") as lh_log:  # the child keeps its own copy of the descriptor
        lighthouse = subprocess.Popen([_lighthouse_binary(), "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                                       "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms",
                                       str(HEARTBEAT_TIMEOUT_MS), "--quorum_tick_ms", str(QUORUM_TICK_MS)],
                                      stdout=lh_log, stderr=subprocess.STDOUT, start_new_session=True)
    env = child_env(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", RUST_LOG="warn")
    # torchrun never restarts a group here (this launcher does): the workers share the agent's store.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)

    def start(g: _Group) -> None:
        g.incarnation += 1
        cmd = [*torchrun(ranks), "-m", "fthsdp.bench.baselines.torchft_train", "--replica-index", str(g.index),
               "--steps", str(steps), "--model", model, "--batch", str(batch), "--lr", str(lr), "--seed", str(seed),
               "--progress", str(g.progress), "--incarnation", str(g.incarnation),
               "--timeout", str(collective_timeout_s)]
        if g.incarnation == 1:
            cmd += ["--barrier", str(barrier)]
            if g.index == kill_replica:
                cmd += ["--kill-step", str(kill_step)]
        g.proc = start_group(cmd, env, g.log)
        g.restart_at = None
        events.append({"t": time.time(), "event": "start", "replica": g.index, "incarnation": g.incarnation})

    load0 = os.getloadavg()[0]
    deadline = time.monotonic() + timeout_s
    try:
        wait_port(port, 30, lighthouse)
        for g in groups:
            start(g)
        went = False
        alone_since = 0.0
        while not all(g.finished for g in groups):
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft run did not finish in {timeout_s}s (logs in {work})")
            if not went and all((barrier / f"ready-{g.index}").exists() for g in groups):
                (barrier / "go").touch()
                went = True
            for g in groups:
                if g.finished or g.proc is None:
                    continue
                if all(o.finished for o in groups if o is not g) and g.incarnation > 1:
                    # Everyone else is done: a restarted group that has not finished within 30 s waits for a
                    # quorum that never comes.
                    alone_since = alone_since or time.monotonic()
                    if time.monotonic() < alone_since + 30:
                        continue
                    kill_group(g.proc)
                    g.finished = True
                    events.append({"t": time.time(), "event": "abandoned", "replica": g.index})
                    continue
                if g.restart_at is not None:
                    if time.monotonic() >= g.restart_at:
                        start(g)
                    continue
                code = g.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    g.finished = True
                    events.append({"t": time.time(), "event": "finished", "replica": g.index})
                    continue
                events.append({"t": time.time(), "event": "exit", "replica": g.index, "code": code})
                if g.incarnation > 3:
                    raise RuntimeError(f"torchft group {g.index} failed {g.incarnation} times; see {g.log}")
                g.restart_at = time.monotonic() + restart_delay_s
            time.sleep(0.02)  # supervision period
    finally:
        for g in groups:
            kill_group(g.proc)
        kill_group(lighthouse)
    per = {g.index: read_progress(g.progress) for g in groups}
    steps_rows = {i: steps_of(rows) for i, rows in per.items()}
    finals = [next((x for x in reversed(rows) if x.event == "final"), None) for rows in per.values()]
    failures = [Failure(e["t"], e["replica"]) for e in events if e["event"] == "exit"]
    m = recovery_metrics(steps_rows, failures, replicas, warmup=warmup)
    hashes = {f.param_hash for f in finals if f}
    return {
        "system": "torchft",
        "step_s": round(m["median_step_s"], 4),
        "stall_s": round(sum(m["stall_per_failure_s"]) / len(failures), 3) if failures else 0.0,
        "rejoin_s": round(m["rejoin_s"], 3) if m["rejoin_s"] is not None else None,
        "ett": round(m["effective_training_time"], 3),
        "final_equal": len(hashes) == 1 and all(finals),
        "lost_s": round(max(m["lost_per_failure_s"]), 3) if failures else 0.0,
        "survivor_max_stall_s": round(m["survivor_max_stall_s"], 3),
        "wall_s": round(m["wall_s"], 2),
        "replica_steps_trained": m["replica_steps_trained"],
        "trained": m["trained"],
        "ett_basis": m["ett_basis"],
        "failures": len(failures),
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "final_steps": [f.step if f else None for f in finals],
        "settings": {"replicas": replicas, "ranks_per_replica": ranks, "steps": steps,
                     "kill": f"{kill_replica}@{kill_step}", "restart_delay_s": restart_delay_s, "model": model,
                     "batch": batch, "lr": lr,
                     "warmup_steps": warmup, "join_timeout_ms": join_timeout_ms,
                     "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                     "lighthouse_min_replicas": 2, "manager_min_replica_size": 2,
                     "timeout_s": collective_timeout_s, "async_quorum": True,
                     "gradient_exchange": "manager.allreduce of one flat bucket after backward + should_commit"
                                          + (", per rank of its FSDP2-sharded gradient (a Manager per rank)"
                                             if ranks > 1 else "")},
        "events": events,
        "progress": {str(i): [x.to_json() for x in rows] for i, rows in steps_rows.items()},
    }


def main() -> None:
    import argparse
    import json
    import tempfile

    p = argparse.ArgumentParser(prog="fthsdp.bench.baselines.torchft_run")
    p.add_argument("--workdir", default="")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS)
    p.add_argument("--ranks", type=int, default=1, help="ranks per replica group (2: the HSDP shape, FSDP2 inside)")
    a = p.parse_args()
    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="fthsdp-torchft-"))
    r = run_torchft(work, steps=a.steps, kill_step=a.kill_step, join_timeout_ms=a.join_timeout_ms,
                    ranks=a.ranks)
    r.pop("progress")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
