"""``fthsdp bench overhead``: steady-state step time of fthsdp against plain FSDP2-HSDP (torch's replicate
dimension over R×S ranks in one torchrun, no fault tolerance), same model, data and settings, in the same run.
Runs alternate (baseline, fthsdp, baseline, ...) so that drift hits both; the first ``warmup`` steps of each run
are excluded from its median. The ratio is the median over rounds of each round's ratio (its fthsdp run's median
step over the baseline run just before it): identical runs drift 10-15% apart on a shared machine, over minutes,
and a ratio of neighbours cancels most of it. The lighthouse runs with its own defaults
(``lighthouse.model.Policy``: heartbeats every 0.5 s), as a user's would; the test launcher's faster heartbeats
(0.1 s) are a setting for tests.

``layout`` (``fsdp``, ``tp2``, ``pp2``: ``fthsdp.examples.layouts``): each replica built as that layout, in the
baseline too (plain HSDP of the same layout: a ``replicate`` dimension added to its mesh).

``against="timeline-off"``: the baseline is fthsdp itself with its step timeline off (``FTHSDP_TIMELINE=0``,
``fthsdp.runtime.timeline``), what keeping every rank's phases costs; the result also gives what one recorded span
costs, measured in this process (``span_cost_us``), and how many a step records (``spans_per_step``): their
product over the step is the cost the end-to-end ratio cannot resolve on a noisy machine."""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import tempfile
import time

from fthsdp.bench.results import OverheadResult
from fthsdp.examples.layouts import LAYOUTS
from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, at_lighthouse_defaults
from fthsdp.launch.procutil import child_env, torchrun
from fthsdp.launch.progress import progress_path, read_progress, steps_of
from fthsdp.runtime.timeline import Timeline
from lighthouse.model import Policy


def _median_step(progress: pathlib.Path, warmup: int, replica: int | None = None) -> float:
    times = [x.step_s for x in steps_of(read_progress(progress))
             if x.step is not None and x.step >= warmup and x.step_s is not None
             and (replica is None or x.replica == replica)]
    if not times:
        raise RuntimeError(f"no steps after warm-up in {progress}")
    return statistics.median(times)


def _baseline(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int,
              layout: str) -> float:
    progress = tmp / "baseline.jsonl"
    progress.unlink(missing_ok=True)
    subprocess.run([*torchrun(replicas * ranks), "-m", "fthsdp.examples.train", "--plain", "--hsdp-replicas",
                    str(replicas), "--model", model, "--steps", str(steps), "--batch", str(batch),
                    "--layout", layout, "--progress", str(progress)],
                   check=True, timeout=1800, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return statistics.median(_median_step(progress, warmup, r) for r in range(replicas))


def _fthsdp(tmp: pathlib.Path, replicas: int, ranks: int, steps: int, model: str, batch: int, warmup: int,
            layout: str, env: dict[str, str] | None = None) -> float:
    work = tmp / f"fthsdp{len(list(tmp.glob('fthsdp*')))}"
    Cluster(at_lighthouse_defaults(ClusterConfig(replicas=replicas, ranks=ranks, steps=steps, model=model,
                                                 batch=batch, timeout_s=1800, layout=layout,
                                                 env={r: dict(env or {}) for r in range(replicas)})), work).run()
    return statistics.median(_median_step(progress_path(work, r), warmup) for r in range(replicas))


def span_cost_us(n: int = 200_000) -> float:
    """What recording one span costs on this machine, in microseconds (the median of 5 runs of ``n``)."""
    costs = []
    for _ in range(5):
        tl = Timeline(epoch=lambda: 1)
        t0 = time.perf_counter()
        for k in range(n):
            tl.span("bucket 0", "exchange", k, 1.0, 2.0)
        costs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(costs)


def spans_per_step(model: str) -> int:
    """Spans a step of the example trainer records on each rank: forward, backward, wait, vote, optimizer, the post
    exchange, and one per bucket (each block's FSDP unit, and the root's)."""
    from fthsdp.examples.gpt import GPTConfig

    return 6 + GPTConfig.named(model).layers + 1


def paired_ratios(base: list[float], ft: list[float]) -> tuple[float, list[float]]:
    """Each round's ratio (its fthsdp run over the baseline run beside it) and their median."""
    if not base or len(base) != len(ft):
        raise ValueError(f"need as many fthsdp runs as baseline runs, at least one ({len(ft)} and {len(base)})")
    ratios = [y / x for x, y in zip(base, ft, strict=True)]
    return statistics.median(ratios), ratios


AGAINST = {"plain": "plain FSDP2-HSDP (replicate x shard mesh, one torchrun)",
           "timeline-off": "fthsdp with its step timeline off (FTHSDP_TIMELINE=0)"}
"""The baselines ``bench_overhead`` measures against."""


def bench_overhead(replicas: int = 3, ranks: int = 2, steps: int = 60, model: str = "reference", batch: int = 8,
                   warmup: int = 5, rounds: int = 3, against: str = "plain", layout: str = "fsdp") -> OverheadResult:
    if against not in AGAINST:
        raise ValueError(f"--against must be one of {', '.join(AGAINST)}, not {against!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout != "fsdp" and ranks % 2:
        raise ValueError(f"--layout {layout} needs an even --ranks (2 model-parallel ranks), got {ranks}")
    if steps <= warmup:
        raise ValueError(f"--steps must exceed the {warmup} warm-up steps")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    base, ft = [], []
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-overhead-") as tmp:
        t = pathlib.Path(tmp)
        for _ in range(rounds):
            base.append(_baseline(t, replicas, ranks, steps, model, batch, warmup, layout) if against == "plain"
                        else _fthsdp(t, replicas, ranks, steps, model, batch, warmup, layout, {"FTHSDP_TIMELINE": "0"}))
            ft.append(_fthsdp(t, replicas, ranks, steps, model, batch, warmup, layout))
    b, f = statistics.median(base), statistics.median(ft)
    timeline = against == "timeline-off"
    ratio, ratios = paired_ratios(base, ft)
    return OverheadResult(replicas=replicas, ranks_per_replica=ranks, model=model, steps=steps, warmup_steps=warmup,
                          rounds=rounds, heartbeat_interval_s=Policy().heartbeat_interval_s,
                          baseline_step_s=round(b, 4), fthsdp_step_s=round(f, 4), step_time_ratio=round(ratio, 3),
                          round_ratios=[round(r, 3) for r in ratios], baseline_runs_s=[round(x, 4) for x in base],
                          fthsdp_runs_s=[round(x, 4) for x in ft],
                          baseline=AGAINST[against] if layout == "fsdp" or timeline else
                          f"plain FSDP2-HSDP of the {layout} layout (a replicate dimension added to its mesh)",
                          span_cost_us=round(span_cost_us(), 3) if timeline else None,
                          spans_per_step=spans_per_step(model) if timeline else None, layout=layout)
