"""``fthsdp bench straggler``: one replica made slow (fail-slow), against the same job with no straggler, in the same
run. The reference workload (docs/design.md §12), 3 replica groups of 1 rank; from step ``slow_from`` replica 2
computes ``factor`` times as long (``FTHSDP_FAULT_SLOW``). Four jobs, run one after the other:

- ``healthy``: no straggler, the lighthouse under ``--straggler-policy eject``: every replica it names (or ejects)
  is a false flag (``false_flags``);
- ``report``: the straggler, policy ``report`` (doing nothing about it): the steps from the slowdown until the
  status names it (``detect_steps``, the status polled every 0.1 s), and the job's throughput from 10 steps
  after the slowdown on, over the healthy job's (``throughput_do_nothing_ratio``);
- ``eject``: the straggler, policy ``eject``: the job's throughput once it is out, over the healthy two-replica
  job's (``throughput_after_ratio``), from ``settle_s`` after the ejected replica's next incarnation registered:
  its start-up (Python, torch, the model, a warm-up step, its first probe) runs on the same 2 cores as the
  survivors here, where on a cluster it has its own hosts. ``throughput_after_incl_restart_ratio`` counts from
  the third step with two contributors on, restart included;
- ``healthy_2``: two replicas, no straggler: the baseline of that ratio.

Throughput is samples trained per second (contributors x batch per committed step), from replica 0's rows (it is
never the straggler); each window leaves out the first ``warmup`` steps.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from fthsdp.bench.results import StragglerResult
from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig
from fthsdp.launch.progress import ProgressRow, progress_path, read_progress, steps_of


@dataclass
class _Watch:
    """Status samples of one job: (the members' newest step, the replicas it names as stragglers)."""

    samples: list[tuple[int, list[str]]]
    polled: float = 0.0

    def __call__(self, cluster: Cluster) -> None:
        if time.monotonic() - self.polled < 0.1:
            return
        self.polled = time.monotonic()
        try:
            doc = cluster.status()
        except OSError:
            return
        steps = [x["step"] for x in doc["members"]]
        if steps:
            self.samples.append((max(steps), [x["replica_id"] for x in doc["stragglers"]]))


def _throughput(rows: list[ProgressRow], batch: int, first: int) -> float:
    """Samples per second over replica 0's committed steps from ``first`` on (contributors x batch per step)."""
    s = [x for x in steps_of(rows) if x.step is not None and x.step >= first and x.contributors]
    if len(s) < 3:
        raise RuntimeError(f"too few steps after step {first} to measure throughput ({len(s)})")
    samples = sum((x.contributors or 0) * batch for x in s[1:])
    return samples / (s[-1].t - s[0].t)


def _throughput_since(rows: list[ProgressRow], batch: int, t0: float) -> float:
    """Samples per second over the committed steps from time ``t0`` on."""
    later = [x.step for x in steps_of(rows) if x.step is not None and x.t >= t0]
    return _throughput(rows, batch, later[0]) if later else 0.0


def _job(work: pathlib.Path, name: str, replicas: int, steps: int, model: str, batch: int, policy: str,
         slow: str) -> tuple[list[ProgressRow], _Watch, dict[str, Any]]:
    watch = _Watch([])
    env = {2: {"FTHSDP_FAULT_SLOW": slow}} if slow else {}
    config = ClusterConfig(replicas=replicas, ranks=1, steps=steps, model=model, batch=batch, timeout_s=1800,
                           straggler_policy=policy, env=env)
    report = Cluster(config, work / name, on_tick=watch).run()
    return read_progress(progress_path(work / name, 0)), watch, report


def bench_straggler(steps: int = 100, slow_from: int = 20, factor: float = 2.0, model: str = "reference",
                    batch: int = 8, warmup: int = 5, settle_s: float = 15.0,
                    workdir: str | None = None) -> StragglerResult:
    """Run the four jobs; see the module doc."""
    if not 0 < slow_from < steps - 20:
        raise ValueError(f"need 0 < slow_from < steps - 20 (got {slow_from} of {steps})")
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-straggler-") as tmp:
        work = pathlib.Path(workdir or tmp)
        slow = f"{slow_from}:{factor}"
        healthy, healthy_watch, healthy_report = _job(work, "healthy", 3, steps, model, batch, "eject", "")
        reported, report_watch, _ = _job(work, "report", 3, steps, model, batch, "report", slow)
        ejected, _, eject_report = _job(work, "eject", 3, steps, model, batch, "eject", slow)
        starts = [x.t for x in read_progress(progress_path(work / "eject", 2)) if x.event == "start"]
        healthy_2, _, _ = _job(work, "healthy_2", 2, steps, model, batch, "report", "")
    false_flags = sorted({rid for _, found in healthy_watch.samples for rid in found}
                         | {e["reason"] for e in healthy_report["events"]
                            if e["event"] == "epoch" and "ejected" in e["reason"]})
    named = [step for step, found in report_watch.samples if "replica-2" in found and step >= slow_from]
    out = [x for x in steps_of(ejected) if x.step is not None and x.contributors == 2 and x.step > slow_from]
    ejections = [e["reason"] for e in eject_report["events"] if e["event"] == "epoch" and "ejected" in e["reason"]]
    base3, base2 = _throughput(healthy, batch, warmup), _throughput(healthy_2, batch, warmup)
    do_nothing = _throughput(reported, batch, slow_from + 10)
    with_restart = _throughput(ejected, batch, out[2].step) if len(out) > 5 and out[2].step is not None else 0.0
    after = _throughput_since(ejected, batch, starts[1] + settle_s) if len(starts) > 1 and out else 0.0
    return StragglerResult(
        replicas=3, steps=steps, model=model, slow_from=slow_from, factor=factor,
        detect_steps=named[0] - slow_from if named else None, false_flags=false_flags,
        ejected_at_step=out[0].step if out else None, ejections=ejections,
        throughput_healthy=round(base3, 3), throughput_healthy_2=round(base2, 3),
        throughput_do_nothing=round(do_nothing, 3), throughput_after_eject=round(after, 3),
        throughput_do_nothing_ratio=round(do_nothing / base3, 3), throughput_after_ratio=round(after / base2, 3),
        throughput_after_incl_restart_ratio=round(with_restart / base2, 3), settle_s=settle_s)
