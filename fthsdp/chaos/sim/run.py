"""Runs of the simulated cluster (``fthsdp chaos --sim``): a seed draws the job's shape and its faults, the run
goes in simulated time, ``checks`` judge its history. ``simulate`` runs many seeds and counts; a failing seed
replays bit for bit with its trace (``--seed N --runs 1 --trace``)."""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import random
import time
from dataclasses import dataclass
from typing import Any

from fthsdp.chaos.sim import checks
from fthsdp.chaos.sim.cluster import BLAME_ALL, FAULT_KINDS, TARGETING, Fault, SimCluster, SimConfig
from fthsdp.chaos.sim.world import World
from lighthouse import membership as m

FAULTS_FROM_S, FAULTS_UNTIL_S = 4.0, 30.0
"""Faults start in this window of simulated time."""
SETTLE_S = 35.0
"""From the last fault's start to the job's end: long enough for every restart, catch-up and re-formed epoch."""
DRAIN_S = 60.0
"""After the end, for every group to finish."""
MAX_EVENTS = 400_000

VARIANTS = {
    "": "the protocol as built",
    "no-confirm": "a failure report kills its suspect at once, even one that heartbeats (confirm_age_s ~ 0): a "
                  "healthy replica blamed over a slow link pays (invariant 7)",
    "reuse-epochs": "the store keeps no epoch counter and members claim none on re-registering: a restarted "
                    "lighthouse numbers epochs from 1 again (invariant 2, and the members ignore the reused "
                    "numbers: no-hang)",
    "local-vote": "the replica-local vote without step reconciliation: a replica whose lanes split on a step (one "
                  "lane completed it, another lost it to a death) redoes it, while its partners committed it; "
                  "nobody serves it the step and it restarts (invariant 7)",
    "unpinned-orphans": "orphan slots carried (as --sim-orphans), each member training what the newest epoch it saw "
                        "deals it and exchanging it in whatever group its lane joins: members of one group dealt "
                        "under different epochs train a slot's part twice or not at all (exactly-once, whole-batch)",
}
"""``--sim-variant``: deliberately broken protocols the checks must catch."""


PLANES = ("lanes", "membership")
"""``lanes``: every replica's ranks run FTAR lanes and the commit protocol (``fthsdp.chaos.sim.trainer``);
``membership``: the membership layer alone, its data plane a model of failure detection (the first simulator)."""


@dataclass(frozen=True)
class Drawn:
    """What a seed draws: the job and its faults."""

    replicas: int
    min_replicas: int
    faults: tuple[Fault, ...]
    lanes: int = 0
    buckets: int = 1
    plane_faults: tuple[Fault, ...] = ()
    """Faults of the lanes plane only (``PLANE_FAULT_KINDS``: drawn apart, so that the membership plane's seeds
    replay as they always did)."""

    def faults_of(self, plane: str) -> tuple[Fault, ...]:
        both = self.faults + self.plane_faults if plane == "lanes" else self.faults
        return tuple(sorted(both, key=lambda f: f.t))


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
    shape = random.Random(f"plane-{seed}")  # its own stream: the membership draw above is what it always was
    lanes, buckets = shape.choice((1, 2, 2, 3)), shape.choice((1, 2, 2, 3))
    faults = [dataclasses.replace(f, mid_exchange=shape.random() < 0.5) if f.kind in ("kill", "double") else f
              for f in faults]
    extra = (Fault(round(shape.uniform(FAULTS_FROM_S, FAULTS_UNTIL_S), 4), "store-leader", (0,),
                   round(shape.uniform(0.5, 3.0), 4)),) if shape.random() < 0.25 else ()
    return Drawn(replicas, min_replicas, tuple(sorted(faults, key=lambda f: f.t)), lanes=lanes, buckets=buckets,
                 plane_faults=extra)


def blame_all_of(seed: int, replicas: int) -> Fault | None:
    """The ``blame-all`` fault of ``seed`` (its own stream: the other draws stay what they always were): who blames
    everyone, when, for how long. None with fewer than 3 replicas: one member blaming the only other is a plain
    report (the ``blame`` kind), which no rule can tell from a true one."""
    if replicas < 3:
        return None
    rng = random.Random(f"blame-all-{seed}")
    return Fault(round(rng.uniform(FAULTS_FROM_S, FAULTS_UNTIL_S), 4), BLAME_ALL, (rng.randrange(replicas),),
                 round(rng.uniform(3.0, 8.0), 4))


def run_one(seed: int, variant: str = "", trace: bool = False, plane: str = "lanes",
            spares: int = 0, blame_all: bool = False, orphans: bool = False) -> dict[str, Any]:
    """One seeded run; its result names the faults, the violations and (with ``trace``) the trace. ``spares``: that
    many spare groups besides the drawn replicas (the faults are drawn as without them: on the replicas).
    ``blame_all``: add the seed's ``blame-all`` fault (``blame_all_of``) to its draw. ``orphans``: the slot holders
    train the slots nobody holds, and every committed step must train every slot (``SimConfig.orphans``)."""
    d = draw(seed)
    if blame_all and (extra := blame_all_of(seed, d.replicas)) is not None:
        d = dataclasses.replace(d, faults=tuple(sorted((*d.faults, extra), key=lambda f: f.t)))
    return run_drawn(seed, d, variant, trace, plane, spares, orphans)


def run_drawn(seed: int, d: Drawn, variant: str = "", trace: bool = False, plane: str = "lanes",
              spares: int = 0, orphans: bool = False) -> dict[str, Any]:
    """``run_one`` on the job and faults ``d`` (a test's own schedule, or a seed's draw); ``seed`` seeds the rest
    (latencies, the world's randomness)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown --sim-variant {variant!r}: one of {', '.join(v for v in VARIANTS if v)}")
    if plane not in PLANES:
        raise ValueError(f"unknown plane {plane!r}: one of {', '.join(PLANES)}")
    if variant == "local-vote" and plane != "lanes":
        raise ValueError("--sim-variant local-vote needs the lanes (the vote is theirs)")
    orphans = orphans or variant == "unpinned-orphans"
    if orphans and plane != "lanes":
        raise ValueError("orphan slots need the lanes (the data is theirs)")
    faults = d.faults_of(plane)
    # The lighthouse's defaults (``fthsdp lighthouse``): heartbeats every 0.5 s, dead after 3 s of silence, a
    # report confirmed by 2 intervals of silence.
    policy = m.Policy(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1e-6 if variant == "no-confirm" else 1.0)
    end_s = max((f.t for f in faults), default=FAULTS_FROM_S) + SETTLE_S
    lanes = d.lanes if plane == "lanes" else 0
    cfg = SimConfig(replicas=d.replicas, min_replicas=d.min_replicas, faults=faults, end_s=end_s, policy=policy,
                    reuse_epochs=variant == "reuse-epochs", lanes=lanes, buckets=d.buckets,
                    reconcile=variant != "local-vote", spares=spares, orphans=orphans,
                    pin_deals=variant != "unpinned-orphans")
    world = World(seed, trace=trace)
    world.log(f"seed {seed}: {d.replicas} replicas" + (f" + {spares} spare" if spares else "")
              + (", orphan slots carried" if orphans else "")
              + f", min {d.min_replicas}"
              + (f", {lanes} lanes, {d.buckets} buckets" if lanes else ", no lanes") + "; faults: "
              + "; ".join(f.describe() for f in faults))
    cluster = SimCluster(world, cfg)
    violations: list[str] = []
    try:
        world.run(end_s + DRAIN_S, MAX_EVENTS)
    except RuntimeError as e:
        violations.append(f"no-hang: {e}")
    lh = cluster.lighthouse
    targets = {i for f in faults if f.kind in TARGETING for i in f.replicas}
    violations += [f"epochs: {v}" for v in checks.epochs_increase(lh.published, lh.lives)]
    violations += [f"epochs: {v}" for v in cluster.stale]
    violations += [f"guard: {v}" for v in checks.guard_holds(lh.published, d.min_replicas)]
    violations += [f"over-for-good: {v}" for v in checks.over_for_good(lh.published, lh.departed, lh.lives,
                                                                        cluster.dropped_seen)]
    groups = d.replicas + spares
    violations += [f"only-failed-pays: {v}" for v in checks.only_failed_pays(cluster.exits, groups, targets, end_s)]
    violations += [f"no-hang: {v}" for v in checks.no_hang(cluster.at_end, groups)]
    violations += [f"no-hang: {v}" for v in checks.finished([g.done for g in cluster.groups])]
    if lanes:
        violations += cluster.plane_violations
        violations += [f"state: {v}" for v in checks.one_final_state(cluster.finished_states, cluster.total_steps)]
        ended = [t for t in cluster.trainers if t.barrier and t.inc in cluster.finished_states]
        died = {x.incarnation for x in cluster.exits if not x.finished}
        dropped = {inc: t for (_, inc), (t, _) in lh.departed.items()}
        violations += [f"state: {v}" for v in checks.histories_agree(
            [checks.History(t.inc, t.history, t.committed_at, t.inc in died, dropped.get(t.inc))
             for t in cluster.trainers], ended[0].history if ended else None)]
    out: dict[str, Any] = {"seed": seed, "replicas": d.replicas, "spares": spares, "orphans": orphans,
                           "min_replicas": d.min_replicas,
                           "lanes": lanes, "buckets": d.buckets if lanes else 0,
                           "faults": [f.describe() for f in faults], "epochs": len(lh.published),
                           "steps_carried": len(cluster.carried),
                           "events": world.events, "violations": violations}
    if trace:
        out["trace"] = world.trace
    return out


def _run_many(args: tuple[int, int, str, str, int, bool, bool]) -> list[dict[str, Any]]:
    """Runs ``seed``..``seed + n - 1`` (one worker's share), without traces."""
    seed, n, variant, plane, spares, blame_all, orphans = args
    return [run_one(s, variant, plane=plane, spares=spares, blame_all=blame_all, orphans=orphans)
            for s in range(seed, seed + n)]


def simulate(seed: int, runs: int, variant: str = "", plane: str = "lanes", jobs: int = 1,
             spares: int = 0, blame_all: bool = False, orphans: bool = False) -> dict[str, Any]:
    """``runs`` runs, seeds ``seed``..``seed + runs - 1``: the counts, and the first failing seeds. ``jobs`` > 1
    shares the seeds among that many processes (each run is a pure function of its seed: the result is the
    same). ``spares``: spare groups in every run; ``blame_all``: every run with 3 replicas or more gets its
    ``blame-all`` fault; ``orphans``: orphan slots carried (``run_one``)."""
    if runs < 1 or jobs < 1:
        raise ValueError(f"runs and jobs must be at least 1, got {runs} and {jobs}")
    if spares < 0 or (spares and plane != "lanes"):
        raise ValueError(f"spares must be >= 0, and need the lanes (got {spares} with plane {plane!r})")
    if orphans and plane != "lanes":
        raise ValueError("orphan slots need the lanes (the data is theirs)")
    t0 = time.monotonic()
    jobs = min(jobs, runs)
    if jobs == 1:
        results = _run_many((seed, runs, variant, plane, spares, blame_all, orphans))
    else:
        share = -(-runs // (jobs * 8))  # several chunks per worker, so that a slow one does not hold the rest
        chunks = [(s, min(share, seed + runs - s), variant, plane, spares, blame_all, orphans)
                  for s in range(seed, seed + runs, share)]
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            results = [r for part in pool.map(_run_many, chunks) for r in part]
    kinds: collections.Counter[str] = collections.Counter()
    by_invariant: collections.Counter[str] = collections.Counter()
    failing: list[dict[str, Any]] = []
    bad = events = carried = 0
    for r in results:
        carried += r["steps_carried"]
        kinds.update(f.kind for f in draw(r["seed"]).faults_of(plane))
        if blame_all and (extra := blame_all_of(r["seed"], r["replicas"])) is not None:
            kinds[extra.kind] += 1
        events += r["events"]
        if r["violations"]:
            bad += 1
            by_invariant.update({v.split(":", 1)[0] for v in r["violations"]})
            if len(failing) < 5:
                failing.append({"seed": r["seed"], "faults": r["faults"], "violations": r["violations"][:5]})
    return {"runs": runs, "seed": seed, "variant": variant, "plane": plane, "spares": spares, "orphans": orphans,
            "blame_all": blame_all, "violations": bad,
            "by_invariant": dict(sorted(by_invariant.items())), "faults_injected": dict(sorted(kinds.items())),
            "first_failing": failing, "events": events, "steps_carried": carried, "jobs": jobs,
            "seconds": round(time.monotonic() - t0, 1)}
