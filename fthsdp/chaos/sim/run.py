"""Runs of the simulated cluster (``fthsdp chaos --sim``): a seed draws the job's shape and its faults, the run
goes in simulated time, ``checks`` judge its history. ``simulate`` runs many seeds and counts; a failing seed
replays bit for bit with its trace (``--seed N --runs 1 --trace``)."""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass
from typing import Any

from fthsdp.chaos.sim import checks
from fthsdp.chaos.sim.cluster import FAULT_KINDS, TARGETING, Fault, SimCluster, SimConfig
from fthsdp.chaos.sim.world import World
from lighthouse import membership as m

FAULTS_FROM_S, FAULTS_UNTIL_S = 4.0, 30.0
"""Faults start in this window of simulated time."""
SETTLE_S = 35.0
"""From the last fault's start to the job's end: long enough for every restart, catch-up and re-formed epoch."""
DRAIN_S = 20.0
"""After the end, for every group to finish."""
MAX_EVENTS = 400_000

VARIANTS = {
    "": "the protocol as built",
    "no-confirm": "a failure report kills its suspect at once, even one that heartbeats (confirm_age_s ~ 0): a "
                  "healthy replica blamed over a slow link pays (invariant 7)",
    "reuse-epochs": "the store keeps no epoch counter and members claim none on re-registering: a restarted "
                    "lighthouse numbers epochs from 1 again (invariant 2, and the members ignore the reused "
                    "numbers: no-hang)",
}
"""``--sim-variant``: deliberately broken protocols the checks must catch."""


@dataclass(frozen=True)
class Drawn:
    """What a seed draws: the job and its faults."""

    replicas: int
    min_replicas: int
    faults: tuple[Fault, ...]


def draw(seed: int, kinds: tuple[str, ...] = FAULT_KINDS) -> Drawn:
    """The job and faults of ``seed`` (a pure function of it)."""
    rng = random.Random(f"faults-{seed}")
    replicas = rng.choice((2, 3, 3, 4))
    min_replicas = rng.choice((1, 1, 2)) if replicas >= 3 else 1
    faults = []
    for _ in range(rng.choice((1, 2, 2, 3, 4))):
        kind = rng.choice(kinds)
        if kind == "double" and replicas < 3:
            kind = "kill"
        who = tuple(sorted(rng.sample(range(replicas), 2 if kind == "double" else 1)))
        duration = {"hang": rng.uniform(4.0, 8.0), "cut": rng.uniform(0.4, 8.0), "blip": rng.uniform(0.1, 0.4),
                    "peers": rng.uniform(3.0, 8.0), "delay": rng.uniform(1.0, 6.0), "dup": rng.uniform(1.0, 6.0),
                    "restart-memory": rng.uniform(0.5, 3.0), "restart-durable": rng.uniform(0.5, 3.0)}.get(kind, 0.0)
        faults.append(Fault(round(rng.uniform(FAULTS_FROM_S, FAULTS_UNTIL_S), 4), kind, who, round(duration, 4),
                            durable=kind == "restart-durable"))
    return Drawn(replicas, min_replicas, tuple(sorted(faults, key=lambda f: f.t)))


def run_one(seed: int, variant: str = "", trace: bool = False) -> dict[str, Any]:
    """One seeded run; its result names the faults, the violations and (with ``trace``) the trace."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown --sim-variant {variant!r}: one of {', '.join(v for v in VARIANTS if v)}")
    d = draw(seed)
    # The lighthouse's defaults (``fthsdp lighthouse``): heartbeats every 0.5 s, dead after 3 s of silence, a
    # report confirmed by 2 intervals of silence.
    policy = m.Policy(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1e-6 if variant == "no-confirm" else 1.0)
    end_s = max((f.t for f in d.faults), default=FAULTS_FROM_S) + SETTLE_S
    cfg = SimConfig(replicas=d.replicas, min_replicas=d.min_replicas, faults=d.faults, end_s=end_s, policy=policy,
                    reuse_epochs=variant == "reuse-epochs")
    world = World(seed, trace=trace)
    world.log(f"seed {seed}: {d.replicas} replicas, min {d.min_replicas}; faults: "
              + "; ".join(f.describe() for f in d.faults))
    cluster = SimCluster(world, cfg)
    violations: list[str] = []
    try:
        world.run(end_s + DRAIN_S, MAX_EVENTS)
    except RuntimeError as e:
        violations.append(f"no-hang: {e}")
    lh = cluster.lighthouse
    targets = {i for f in d.faults if f.kind in TARGETING for i in f.replicas}
    violations += [f"epochs: {v}" for v in checks.epochs_increase(lh.published, lh.lives)]
    violations += [f"epochs: {v}" for v in cluster.stale]
    violations += [f"guard: {v}" for v in checks.guard_holds(lh.published, d.min_replicas)]
    violations += [f"over-for-good: {v}" for v in checks.over_for_good(lh.published, lh.departed, lh.lives,
                                                                        cluster.dropped_seen)]
    violations += [f"only-failed-pays: {v}" for v in checks.only_failed_pays(cluster.exits, d.replicas, targets,
                                                                              end_s)]
    violations += [f"no-hang: {v}" for v in checks.no_hang(cluster.at_end, d.replicas)]
    violations += [f"no-hang: {v}" for v in checks.finished([g.done for g in cluster.groups])]
    out: dict[str, Any] = {"seed": seed, "replicas": d.replicas, "min_replicas": d.min_replicas,
                           "faults": [f.describe() for f in d.faults], "epochs": len(lh.published),
                           "events": world.events, "violations": violations}
    if trace:
        out["trace"] = world.trace
    return out


def simulate(seed: int, runs: int, variant: str = "") -> dict[str, Any]:
    """``runs`` runs, seeds ``seed``..``seed + runs - 1``: the counts, and the first failing seeds."""
    t0 = time.monotonic()
    kinds: collections.Counter[str] = collections.Counter()
    by_invariant: collections.Counter[str] = collections.Counter()
    failing: list[dict[str, Any]] = []
    bad = events = 0
    for s in range(seed, seed + runs):
        r = run_one(s, variant)
        kinds.update(f.kind for f in draw(s).faults)
        events += r["events"]
        if r["violations"]:
            bad += 1
            by_invariant.update({v.split(":", 1)[0] for v in r["violations"]})
            if len(failing) < 5:
                failing.append({"seed": s, "faults": r["faults"], "violations": r["violations"][:5]})
    return {"runs": runs, "seed": seed, "variant": variant, "violations": bad,
            "by_invariant": dict(sorted(by_invariant.items())), "faults_injected": dict(sorted(kinds.items())),
            "first_failing": failing, "events": events, "seconds": round(time.monotonic() - t0, 1)}
