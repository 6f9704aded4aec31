"""``fthsdp bench overhead``: steady-state step time of fthsdp against plain FSDP2-HSDP (torch's replicate
dimension over R×S ranks in one torchrun, no fault tolerance), same model, data and settings, in the same run.
Runs alternate (baseline, fthsdp, baseline, ...) so that drift hits both; the first ``warmup`` steps of each run
are excluded from its median."""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import tempfile

from fthsdp.bench.results import OverheadResult
from fthsdp.testing.launcher import Cluster, ClusterConfig
from fthsdp.testing.procutil import child_env, torchrun
from fthsdp.testing.progress import progress_path, read_progress, steps_of


def _median_step(progress: pathlib.Path, warmup: int, replica: int | None = None) -> float:
    times = [x.step_s for x in steps_of(read_progress(progress))
             if x.step is not None and x.step >= warmup and x.step_s is not None
             and (replica is None or x.replica == replica)]
    if not times:
        raise RuntimeError(f"no steps after warm-up in {progress}")
    return statistics.median(times)


def _baseline(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int) -> float:
    progress = tmp / "baseline.jsonl"
    progress.unlink(missing_ok=True)
    subprocess.run([*torchrun(replicas * ranks), "-m", "fthsdp.examples.train", "--plain", "--hsdp-replicas",
                    str(replicas), "--model", model, "--steps", str(steps), "--batch", str(batch),
                    "--progress", str(progress)],
                   check=True, timeout=1800, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return statistics.median(_median_step(progress, warmup, r) for r in range(replicas))


def _fthsdp(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int) -> float:
    work = tmp / f"fthsdp{len(list(tmp.glob('fthsdp*')))}"
    Cluster(ClusterConfig(replicas=replicas, ranks=ranks, steps=steps, model=model, batch=batch,
                          timeout_s=1800), work).run()
    return statistics.median(_median_step(progress_path(work, r), warmup) for r in range(replicas))


def bench_overhead(replicas: int = 3, ranks: int = 2, steps: int = 60, model: str = "reference", batch: int = 8,
                   warmup: int = 5, rounds: int = 1) -> OverheadResult:
    if steps <= warmup:
        raise ValueError(f"--steps must exceed the {warmup} warm-up steps")
    base, ft = [], []
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-overhead-") as tmp:
        t = pathlib.Path(tmp)
        for _ in range(rounds):
            base.append(_baseline(t, replicas, ranks, steps, model, batch, warmup))
            ft.append(_fthsdp(t, replicas, ranks, steps, model, batch, warmup))
    b, f = statistics.median(base), statistics.median(ft)
    return OverheadResult(replicas=replicas, ranks_per_replica=ranks, model=model, steps=steps, warmup_steps=warmup,
                          rounds=rounds, baseline_step_s=round(b, 4), fthsdp_step_s=round(f, 4),
                          step_time_ratio=round(f / b, 3), baseline_runs_s=[round(x, 4) for x in base],
                          fthsdp_runs_s=[round(x, 4) for x in ft])
