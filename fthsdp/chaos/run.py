"""One chaos run and many: ``run_chaos`` runs one seed's schedule on a local cluster and checks every invariant of
docs/design.md §8 over what it left behind (``fthsdp.testing.invariants``); ``soak`` repeats runs with successive seeds
(``fthsdp chaos``). A run's result (JSON) holds the schedule, what was injected and not, the exits, the replicas
the faults targeted (every other one is held to invariant 7, only the failed replica pays), the violations.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

from fthsdp.chaos.cluster import ChaosCluster
from fthsdp.chaos.config import ChaosConfig
from fthsdp.chaos.injector import Injector
from fthsdp.chaos.report import fail_slow_violations, kind_key
from fthsdp.chaos.schedule import Fault, schedule
from fthsdp.launch.config import ReplicaFailed
from fthsdp.testing import invariants
from fthsdp.testing.etcd import EtcdCluster


def run_chaos(cfg: ChaosConfig, workdir: pathlib.Path, faults: list[Fault] | None = None) -> dict[str, Any]:
    """One run of ``cfg.seed``'s schedule (or of ``faults``, a schedule made by hand); the result holds the
    schedule, what was injected, the violations and every replica's final state."""
    if faults is None:
        faults = schedule(cfg.seed, cfg.replicas, cfg.steps, cfg.run_kinds, cfg.faults, hang_s=cfg.hang_s,
                          ranks=cfg.ranks)
    workdir.mkdir(parents=True, exist_ok=True)
    injector = Injector(faults, last_step=int(cfg.steps * cfg.last_fault_at))
    etcd = EtcdCluster(workdir, members=3).start(deadline_s=60.0) if cfg.ha else None
    t0 = time.monotonic()
    report: dict[str, Any] | None = None
    violations: list[str] = []
    targets: list[int] = []
    cluster = ChaosCluster(cfg.cluster_config(len(faults)), workdir, injector.tick, etcd=etcd,
                           lighthouses=cfg.lighthouses)
    try:
        report = cluster.run()
    except (TimeoutError, ReplicaFailed, RuntimeError) as e:
        violations.append(f"run: {type(e).__name__}: {e}")
    finally:
        injector.finish()
        if etcd is not None:
            etcd.stop()
    violations += [f"no-hang: after {x['describe']}: {x['why']}" for x in injector.stuck]
    # No chaos fault makes a replica slow, and the trainers' compute is a steady stand-in (``compute_s``).
    violations += fail_slow_violations(injector.stragglers_named)
    if report is not None:
        report["events"] += injector.epochs_seen
        per = invariants.load_run(workdir, cfg.replicas)
        violations += invariants.check_run(report, per, cfg.steps)
        targets = sorted(invariants.fault_targets(report))
        (workdir / "report.json").write_text(json.dumps(report))
    else:
        # No report: still check what can be checked over the epochs seen.
        violations += [f"epochs: {v}" for v in invariants.epochs_increasing({"events": injector.epochs_seen})]
    exits = [e for e in cluster.events if e["event"] == "exit"]
    result = {
        "seed": cfg.seed, "ha": cfg.ha, "replicas": cfg.replicas, "steps": cfg.steps,
        "schedule": [f.to_json() for f in faults],
        "injected": injector.injected, "not_fired": injector.not_fired,
        "injected_by_kind": dict(collections.Counter(kind_key(x) for x in injector.injected)),
        "exits": [{"replica": e["replica"], "code": e["code"], "killed": e["killed"]} for e in exits],
        "epochs": max((e["epoch"] for e in injector.epochs_seen), default=0),
        "fault_targets": targets,
        "stragglers_named": sorted({x["replica"] for x in injector.stragglers_named}),
        "finals": {r: None if f is None else {"step": f["step"], "param_hash": f["param_hash"]}
                   for r, f in (report or {}).get("final", {}).items()},
        "violations": violations, "wall_s": round(time.monotonic() - t0, 1), "workdir": str(workdir),
    }
    (workdir / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def soak(cfg: ChaosConfig, workdir: pathlib.Path, runs: int = 1, duration_s: float = 0.0, keep: bool = False,
         on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``runs`` runs (or as many as fit in ``duration_s``), seeds ``cfg.seed``, ``cfg.seed + 1``, ...; the
    working directory of a run without violations is removed unless ``keep``."""
    t0 = time.monotonic()
    results = []
    i = 0
    while (i < runs) if not duration_s else (time.monotonic() - t0 < duration_s):
        one = dataclasses.replace(cfg, seed=cfg.seed + i)
        d = workdir / f"seed{one.seed}"
        if d.exists():
            shutil.rmtree(d)
        r = run_chaos(one, d)
        results.append(r)
        if on_result is not None:
            on_result(r)
        if not r["violations"] and not keep:
            shutil.rmtree(d, ignore_errors=True)
        i += 1
    by_kind: collections.Counter[str] = collections.Counter()
    for r in results:
        by_kind.update(r["injected_by_kind"])
    return {
        "runs": len(results), "seeds": [r["seed"] for r in results],
        "faults_injected": sum(len(r["injected"]) for r in results), "by_kind": dict(by_kind),
        "not_fired": sum(len(r["not_fired"]) for r in results),
        "violations": {r["seed"]: r["violations"] for r in results if r["violations"]},
        "wall_s": round(time.monotonic() - t0, 1), "results": results,
    }
