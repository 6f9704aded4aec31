"""The steady-step baseline: plain FSDP2-HSDP (``fthsdp.examples.train --plain --hsdp-replicas R``: torch's
replicate x shard mesh over every rank, one torchrun, no fault tolerance, no failure), as ``fthsdp bench
overhead`` runs it. ``step_s`` is the median gap between two commits of one replica, first ``warmup`` steps
excluded, the same measure as the other systems'."""

from __future__ import annotations

import os
import pathlib
import statistics
import time
from typing import Any

from fthsdp.launch.procutil import child_env, run_to_completion, torchrun
from fthsdp.launch.progress import read_progress
from fthsdp.launch.recovery_metrics import WARMUP_STEPS, recovery_metrics


def run_plain(workdir: pathlib.Path | str, steps: int = 60, seed: int = 0, replicas: int = 3, ranks: int = 1,
              model: str = "reference", batch: int = 8, lr: float = 3e-4, timeout_s: float = 900.0,
              warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    progress = work / "plain.progress.jsonl"
    progress.unlink(missing_ok=True)
    cmd = [*torchrun(replicas * ranks), "-m", "fthsdp.examples.train", "--plain", "--hsdp-replicas", str(replicas),
           "--model", model, "--steps", str(steps), "--batch", str(batch), "--lr", str(lr), "--seed", str(seed),
           "--progress", str(progress)]
    load0 = os.getloadavg()[0]
    run_to_completion(cmd, child_env(), work / "plain.log", timeout_s, "plain baseline")
    rows = read_progress(progress)
    steps_rows = {r: [x for x in rows if x.event == "step" and x.replica == r] for r in range(replicas)}
    m = recovery_metrics(steps_rows, [], replicas, warmup=warmup)
    compute = [x.step_s for v in steps_rows.values() for x in v
               if x.step is not None and x.step >= warmup and x.step_s is not None]
    return {
        "system": "plain FSDP2-HSDP",
        "step_s": round(m["median_step_s"], 4),
        "step_compute_s": round(statistics.median(compute), 4) if compute else None,
        "stall_s": 0.0,
        "rejoin_s": None,
        "ett": round(m["effective_training_time"], 3),
        "wall_s": round(m["wall_s"], 2),
        "t_start": time.time(),
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "settings": {"replicas": replicas, "ranks_per_replica": ranks, "steps": steps, "model": model,
                     "batch": batch, "lr": lr, "warmup_steps": warmup, "failures": "none"},
    }
