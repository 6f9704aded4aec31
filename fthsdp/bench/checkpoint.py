"""``fthsdp bench checkpoint``: what a periodic checkpoint costs the step, written on the training thread (``sync``)
and behind the steps (``async``, ``fthsdp.runtime.checkpoint_writer``), each against the steps of the same run that
no checkpoint touched.

Each run is the reference job (R replicas x S ranks, ``FTHSDP_CHECKPOINT_EVERY=every``); every contributing replica
writes a share of each checkpoint (``fthsdp.runtime.checkpoint.split``), and a replica slowed by its share holds the
others at the next exchange, so replica 0's steps are the job's. A checkpoint is taken as step ``s`` commits
(``s + 1`` a multiple of ``every``): written on the training thread it lengthens step ``s`` (its row's ``step_s``
runs from ``zero_grad`` to the end of ``step()``), written behind it lands in the steps after: the *window* is steps
``s .. s+window``. ``during_s`` is the mean step in the windows, ``steady_s`` the median of the other steps past the
warm-up, and ``ratio`` their quotient (the issue's bar: async at most 1.05). Modes alternate within a round so that
drift hits both."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, at_lighthouse_defaults
from fthsdp.launch.progress import progress_path, read_progress, steps_of

MODES = ("sync", "async")


@dataclass(frozen=True)
class CheckpointRun:
    """One run's figures (``fthsdp.bench.checkpoint``'s module doc)."""

    mode: str
    during_s: float
    steady_s: float
    ratio: float
    checkpoints: int


@dataclass(frozen=True)
class CheckpointResult:
    replicas: int
    ranks_per_replica: int
    model: str
    steps: int
    every: int
    window: int
    warmup_steps: int
    runs: list[CheckpointRun]
    ratio: dict[str, float]
    """Per mode, the median of its runs' ratios."""
    benchmark: str = "checkpoint"
    baseline: str = "the same run's steps no checkpoint touched"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_ratio(rows: list[tuple[int, float]], every: int, window: int, warmup: int) -> tuple[float, float, int]:
    """(mean step in the checkpoint windows, median of the other steps past ``warmup``, checkpoints seen) from
    (step, step_s) rows; ``ValueError`` when either side is empty."""
    marks = sorted({s for s, _ in rows if s >= warmup and (s + 1) % every == 0})
    hit = {s + k for s in marks for k in range(window + 1)}
    during = [t for s, t in rows if s in hit]
    steady = [t for s, t in rows if s >= warmup and s not in hit]
    if not during or not steady:
        raise ValueError(f"need steps in and out of checkpoint windows past step {warmup} (every {every})")
    return statistics.fmean(during), statistics.median(steady), len(marks)


def _run(tmp: pathlib.Path, mode: str, replicas: int, ranks: int, steps: int, model: str, every: int, window: int,
         warmup: int) -> CheckpointRun:
    work = tmp / f"{mode}{len(list(tmp.glob(mode + '*')))}"
    env = {"FTHSDP_CHECKPOINT_ASYNC": "1" if mode == "async" else "0"}
    Cluster(at_lighthouse_defaults(ClusterConfig(replicas=replicas, ranks=ranks, steps=steps, model=model,
                                                 checkpoint_every=every, timeout_s=1800,
                                                 env={i: env for i in range(replicas)})), work).run()
    rows = [(x.step, x.step_s) for x in steps_of(read_progress(progress_path(work, 0)))
            if x.step is not None and x.step_s is not None]
    during, steady, n = step_ratio(rows, every, window, warmup)
    return CheckpointRun(mode, round(during, 4), round(steady, 4), round(during / steady, 3), n)


def bench_checkpoint(replicas: int = 3, ranks: int = 2, steps: int = 60, model: str = "reference", every: int = 10,
                     window: int = 2, warmup: int = 5, rounds: int = 1, workdir: str | None = None) -> CheckpointResult:
    """The runs (``rounds`` of sync then async), in ``workdir`` (kept) or a temporary folder (removed)."""
    if every < 2 or window < 1 or window >= every:
        raise ValueError(f"need --every >= 2 and 1 <= --window < --every (got {every}, {window})")
    if steps < warmup + 2 * every or rounds < 1:
        raise ValueError(f"need --steps >= warm-up + 2 x --every ({warmup + 2 * every}) and --rounds >= 1")
    runs: list[CheckpointRun] = []
    with contextlib.ExitStack() as stack:
        tmp = workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="fthsdp-bench-checkpoint-"))
        for _ in range(rounds):
            runs += [_run(pathlib.Path(tmp), mode, replicas, ranks, steps, model, every, window, warmup)
                     for mode in MODES]
    ratio = {mode: statistics.median(r.ratio for r in runs if r.mode == mode) for mode in MODES}
    return CheckpointResult(replicas, ranks, model, steps, every, window, warmup, runs, ratio)


def format_checkpoint(r: CheckpointResult) -> str:
    lines = [f"{r.replicas} replicas x {r.ranks_per_replica} ranks, {r.model} model, a checkpoint every {r.every} "
             f"steps; window {r.window} step(s) after each"]
    lines += [f"  {x.mode:5s} step during a checkpoint {x.during_s}s, steady {x.steady_s}s: ratio {x.ratio} "
              f"({x.checkpoints} checkpoints)" for x in r.runs]
    lines.append("  ratio (median): " + ", ".join(f"{m} {v}" for m, v in r.ratio.items()))
    return "\n".join(lines)
