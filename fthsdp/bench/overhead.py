"""``fthsdp bench overhead``: steady-state step time of fthsdp against plain FSDP2-HSDP (torch's replicate
dimension over R×S ranks in one torchrun, no fault tolerance), same model, data and settings, in the same run.
Runs alternate (baseline, fthsdp, baseline, ...) so that drift hits both; the first ``warmup`` steps of each run
are excluded from its median."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from fthsdp.testing.launcher import Cluster, ClusterConfig


def _median_step(progress: pathlib.Path, warmup: int, replica: int | None = None) -> float:
    rows = [json.loads(x) for x in progress.read_text().splitlines()]
    times = [x["step_s"] for x in rows if x["event"] == "step" and x["step"] >= warmup
             and (replica is None or x["replica"] == replica)]
    if not times:
        raise RuntimeError(f"no steps after warm-up in {progress}")
    return statistics.median(times)


def _baseline(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int) -> float:
    progress = tmp / "baseline.jsonl"
    progress.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(replicas * ranks), "-m", "fthsdp.examples.train", "--plain", "--hsdp-replicas", str(replicas),
                    "--model", model, "--steps", str(steps), "--batch", str(batch), "--progress", str(progress)],
                   check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return statistics.median(_median_step(progress, warmup, r) for r in range(replicas))


def _fthsdp(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int) -> float:
    work = tmp / f"fthsdp{len(list(tmp.glob('fthsdp*')))}"
    Cluster(ClusterConfig(replicas=replicas, ranks=ranks, steps=steps, model=model, batch=batch,
                          timeout_s=1800), work).run()
    return statistics.median(_median_step(work / f"replica{r}.progress.jsonl", warmup) for r in range(replicas))


def bench_overhead(replicas: int = 3, ranks: int = 2, steps: int = 60, model: str = "reference", batch: int = 8,
                   warmup: int = 5, rounds: int = 1) -> dict[str, Any]:
    if steps <= warmup:
        raise ValueError(f"--steps must exceed the {warmup} warm-up steps")
    base, ft = [], []
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-overhead-") as tmp:
        t = pathlib.Path(tmp)
        for _ in range(rounds):
            base.append(_baseline(t, replicas, ranks, steps, model, batch, warmup))
            ft.append(_fthsdp(t, replicas, ranks, steps, model, batch, warmup))
    b, f = statistics.median(base), statistics.median(ft)
    return {
        "benchmark": "overhead",
        "replicas": replicas,
        "ranks_per_replica": ranks,
        "model": model,
        "steps": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "baseline": "plain FSDP2-HSDP (replicate x shard mesh, one torchrun)",
        "baseline_step_s": round(b, 4),
        "fthsdp_step_s": round(f, 4),
        "step_time_ratio": round(f / b, 3),
        "baseline_runs_s": [round(x, 4) for x in base],
        "fthsdp_runs_s": [round(x, 4) for x in ft],
    }
