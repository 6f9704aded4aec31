"""The whole-job restart baseline (what torchrun elastic does): one torchrun of every rank of every replica
training plain FSDP2-HSDP with a DCP checkpoint every 5 steps (``fthsdp.bench.baselines.restart_train``); one worker
is SIGKILLed at ``kill_step``; torchrun (``--max-restarts 1``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that
the restarted workers do not read the dead ones' addresses, docs/design.md §10) stops and restarts every
worker, which reload the newest checkpoint and train on.

There are no survivors: the stall is the time from the kill to the first step committed after the restart
(``resume_s``) plus the steps lost since the last checkpoint times the median step (docs/design.md §12).
``stall_measured_s`` counts the steps this run lost (none when the kill lands right after a checkpoint, as at
step 20 with one every 5); ``stall_s`` counts the average loss of a failure at a random time,
``checkpoint_every / 2`` steps. ``rejoin_s`` is ``resume_s``. torchrun restarts at once (no
``restart_delay_s``, which the fault-tolerant runs pay): generous to the baseline.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from typing import Any

from fthsdp.launch.procutil import child_env, run_to_completion, torchrun
from fthsdp.launch.progress import progress_path, read_progress, steps_of
from fthsdp.launch.recovery_metrics import WARMUP_STEPS, Failure, recovery_metrics, whole_job_restart_metrics


def run_restart(workdir: pathlib.Path | str, steps: int = 60, kill_step: int = 20, seed: int = 0,
                replicas: int = 3, ranks: int = 1, kill_replica: int = 1, checkpoint_every: int = 5,
                model: str = "reference", batch: int = 8, lr: float = 3e-4, timeout_s: float = 900.0,
                warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    for f in work.glob("replica*.progress.jsonl"):
        f.unlink()
    cmd = [*torchrun(replicas * ranks, max_restarts=1), "-m", "fthsdp.bench.baselines.restart_train",
           "--hsdp-replicas", str(replicas), "--steps", str(steps), "--model", model, "--batch", str(batch),
           "--lr", str(lr), "--seed", str(seed), "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", str(checkpoint_every), "--progress-dir", str(work)]
    if kill_step >= 0:
        cmd += ["--kill", f"{kill_replica}@{kill_step}"]
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    t_start = time.time()
    load0 = os.getloadavg()[0]
    run_to_completion(cmd, env, work / "torchrun.log", timeout_s, "restart baseline")
    per = {i: read_progress(progress_path(work, i)) for i in range(replicas)}
    steps_rows = {i: steps_of(rows) for i, rows in per.items()}
    kills = [x for rows in per.values() for x in rows if x.event == "kill"]
    finals = [next((x for x in reversed(rows) if x.event == "final"), None) for rows in per.values()]
    restored = [x for rows in per.values() for x in rows if x.event == "restored"]
    saves = [x.extra["save_s"] for rows in per.values() for x in rows if x.event == "checkpoint"]
    result: dict[str, Any] = {"system": "whole-job restart"}
    if kills:
        kill = kills[0]
        m = whole_job_restart_metrics(steps_rows, Failure(kill.t, kill.replica or 0, kill.incarnation), replicas,
                                      warmup=warmup)
        # The kill lands at a fixed step, so the steps lost since the last checkpoint depend on where the
        # schedule puts checkpoints (at step 20 with one every 5: none). A failure at a random time loses
        # checkpoint_every / 2 steps on average: that is the stall reported; the measured one is beside it.
        expected = m["resume_s"] + checkpoint_every / 2 * m["median_step_s"]
        result.update(stall_s=round(expected, 3), stall_measured_s=round(m["stall_per_failure_s"][0], 3),
                      rejoin_s=round(m["rejoin_s"], 3), resume_s=round(m["resume_s"], 3),
                      lost_steps=m["lost_steps"], restart_from_step=m["restart_from_step"])
    else:
        m = recovery_metrics(steps_rows, [], replicas, warmup=warmup)
        result.update(stall_s=0.0, rejoin_s=None)
    hashes = {f.local_param_hash for f in finals if f}
    result.update(
        step_s=round(m["median_step_s"], 4), ett=round(m["effective_training_time"], 3),
        final_equal=len(hashes) == 1 and all(finals), wall_s=round(m["wall_s"], 2),
        replica_steps_trained=m["replica_steps_trained"], trained=m["trained"], ett_basis=m["ett_basis"],
        failures=len(kills),
        checkpoint_save_s=round(sorted(saves)[len(saves) // 2], 3) if saves else None,
        checkpoint_load_s=round(max(x.extra["load_s"] for x in restored), 3) if restored else None,
        t_start=t_start, loadavg_1min=[round(load0, 2), round(os.getloadavg()[0], 2)],
        settings={"replicas": replicas, "ranks_per_replica": ranks, "steps": steps,
                  "kill": f"{kill_replica}@{kill_step}", "checkpoint_every": checkpoint_every, "model": model,
                  "batch": batch, "lr": lr, "warmup_steps": warmup, "torchrun_max_restarts": 1,
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "restart_delay_s": 0.0},
        progress={str(i): [x.to_json() for x in rows] for i, rows in steps_rows.items()},
    )
    return result


def main() -> None:
    import argparse
    import json
    import tempfile

    p = argparse.ArgumentParser(prog="fthsdp.bench.baselines.restart")
    p.add_argument("--workdir", default="")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    a = p.parse_args()
    r = run_restart(pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="fthsdp-restart-")), steps=a.steps,
                    kill_step=a.kill_step)
    r.pop("progress")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
