"""``fthsdp sim``: effective training time (ETT) of a job of G GPUs in replicas of g GPUs, under failures, for
whole-job restarts (``sync``) and for fthsdp, by discrete events over a horizon, with closed forms to check.

Model (times in minutes):
- Failures arrive every ``mtbf`` minutes (``fixed``) or as a Poisson process of that mean (``poisson``), over
  wall time, recoveries included; each hits one replica (round-robin when fixed, uniformly at random otherwise).
- ``sync``: a failure stops every GPU for ``sync_recovery`` minutes. A failure during a recovery restarts it
  (the job is down until ``sync_recovery`` after the last failure).
- ``fthsdp``: a failure stalls every GPU for ``stall`` minutes, and its replica trains again ``rejoin`` minutes
  after the failure (``rejoin`` counts from the failure, so it includes the stall). A failure on a replica that
  is already down extends its downtime the same way.
- ETT = GPU-minutes spent training / (G × horizon).

Closed forms. Fixed arrivals (recoveries shorter than the gap, so nothing overlaps):
``sync = 1 - X/M`` and ``fthsdp = 1 - (S + (R - S)·g/G)/M``. Poisson arrivals, as the horizon grows: a minute
trains if no failure came in the last X (sync), or none in the last S and none on its replica in the R - S
before that (fthsdp), so ``sync → exp(-X/M)`` and ``fthsdp → exp(-(S + (R - S)·g/G)/M)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from fthsdp.bench.results import ModeEtt, SimResult


@dataclass(frozen=True)
class SimConfig:
    gpus: int
    replica_gpus: int
    mtbf_min: float
    """The whole job's mean time between failures."""
    sync_recovery_min: float
    """Whole-job restart: downtime per failure."""
    stall_min: float
    """fthsdp: whole-job stall per failure."""
    rejoin_min: float
    """fthsdp: from a failure until its replica trains again."""
    arrivals: str = "fixed"
    seed: int = 0
    hours: float = 1000.0

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.replica_gpus <= 0 or self.gpus % self.replica_gpus:
            raise ValueError(f"--gpus {self.gpus} must be a positive multiple of --replica-gpus {self.replica_gpus}")
        if self.mtbf_min <= 0 or self.hours <= 0:
            raise ValueError("--mtbf-min and --hours must be > 0")
        if min(self.sync_recovery_min, self.stall_min, self.rejoin_min) < 0:
            raise ValueError("recovery, stall and rejoin times must be >= 0")
        if self.arrivals not in ("fixed", "poisson"):
            raise ValueError(f"--arrivals must be fixed or poisson, got {self.arrivals!r}")

    @property
    def replicas(self) -> int:
        return self.gpus // self.replica_gpus


def closed_form(c: SimConfig) -> dict[str, float]:
    """ETT under fixed arrivals (exact when nothing overlaps) and the Poisson limit."""
    lost = c.stall_min + max(0.0, c.rejoin_min - c.stall_min) / c.replicas
    return {
        "sync_fixed": max(0.0, 1 - c.sync_recovery_min / c.mtbf_min),
        "fthsdp_fixed": max(0.0, 1 - lost / c.mtbf_min),
        "sync_poisson_limit": math.exp(-c.sync_recovery_min / c.mtbf_min),
        "fthsdp_poisson_limit": math.exp(-lost / c.mtbf_min),
    }


def _failures(c: SimConfig, horizon: float) -> list[tuple[float, int]]:
    if c.arrivals == "fixed":
        n = int(horizon // c.mtbf_min)
        return [(i * c.mtbf_min, i % c.replicas) for i in range(n)]
    rng = random.Random(c.seed)
    out, t = [], rng.expovariate(1 / c.mtbf_min)
    while t < horizon:
        out.append((t, rng.randrange(c.replicas)))
        t += rng.expovariate(1 / c.mtbf_min)
    return out


def _union(intervals: list[tuple[float, float]], horizon: float) -> float:
    """Total length of the union of intervals (sorted by start), clipped to [0, horizon]."""
    total, end = 0.0, -math.inf
    for a, b in intervals:
        a, b = max(a, end, 0.0), min(b, horizon)
        if b > a:
            total += b - a
        end = max(end, b)
    return total


def simulate(c: SimConfig) -> SimResult:
    """Run both modes over the same failures; ETT of each, with the closed forms beside them."""
    # Fixed arrivals: a whole number of gaps, so the simulation matches the closed form exactly.
    horizon = c.hours * 60
    if c.arrivals == "fixed":
        horizon = max(1, int(horizon // c.mtbf_min)) * c.mtbf_min
    failures = _failures(c, horizon)
    sync_down = _union([(t, t + c.sync_recovery_min) for t, _ in failures], horizon)
    stalls = [(t, t + c.stall_min) for t, _ in failures]
    lost = 0.0
    for r in range(c.replicas):
        down = [(t, t + c.rejoin_min) for t, hit in failures if hit == r]
        lost += _union(sorted(stalls + down), horizon)
    forms = closed_form(c)
    return SimResult(config=asdict(c), replicas=c.replicas, horizon_min=horizon, failures=len(failures),
                     sync=ModeEtt(1 - sync_down / horizon, forms["sync_fixed"], forms["sync_poisson_limit"]),
                     fthsdp=ModeEtt(1 - lost / (c.replicas * horizon), forms["fthsdp_fixed"],
                                    forms["fthsdp_poisson_limit"]))
