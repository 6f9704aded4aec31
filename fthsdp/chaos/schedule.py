"""The seeded fault schedule of a chaos run: a pure function (seed, replicas, steps, kinds -> faults), the same
arguments always giving the same list.

Kinds (``KINDS``): ``kill`` (SIGKILL of a replica group at a phase of a step, or while it serves a catch-up snapshot
to a joiner, ``serve``, or while it fetches one, ``fetch``), ``hang`` (SIGSTOP of a whole group, SIGCONT a few
seconds later), ``double`` (two groups SIGKILLed at the same step), ``rank-hang`` and ``rank-kill`` (SIGSTOP, for
``hang_s``, or SIGKILL of one rank of a group alone, its siblings and its torchrun agent left alone; drawn only when
asked for: ``RANK_KINDS``), and with HA ``lighthouse`` (SIGKILL of the leading
lighthouse) and ``etcd`` (SIGKILL of one etcd member). The phases are the fault hook's (``fthsdp.runtime.faults``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from fthsdp.runtime.faults import PHASES, STEP_PHASES

KILL_PHASES = PHASES
"""A kill's phase: a step's, or catch-up's (serving a snapshot, fetching one)."""
REPLICA_KINDS = ("kill", "hang", "double")
RANK_KINDS = ("rank-hang", "rank-kill")
"""Faults of one rank inside a group (not in the default draw, so that a seed's schedule of replica faults stays
what it was)."""
HA_KINDS = ("lighthouse", "etcd")
KINDS = REPLICA_KINDS + RANK_KINDS + HA_KINDS


@dataclass(frozen=True)
class Fault:
    """One failure of a schedule. ``step``: armed once some replica committed this step (and the previous fault
    is over). ``replicas``/``phases``: the targets of a kill (two for ``double``; for a ``serve`` kill, the first
    is the joiner killed to make the second serve); ``ranks``: the rank of ``replicas[0]`` a rank fault hits;
    ``hang_s``/``down_s``: how long a group (or a rank) stays stopped, a lighthouse or etcd member stays down."""

    kind: str
    step: int
    replicas: tuple[int, ...] = ()
    phases: tuple[str, ...] = ()
    hang_s: float = 0.0
    down_s: float = 0.0
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not among {KINDS}")
        wrong = [p for p in self.phases if p not in KILL_PHASES]
        if wrong:  # a kill armed at a phase no replica passes would never fire
            raise ValueError(f"fault phases {wrong} are not among {[str(p) for p in KILL_PHASES]}")

    def describe(self) -> str:
        if self.kind == "kill":
            if self.phases[-1] == "serve":
                return f"kill r{self.replicas[1]}@serve (joiner r{self.replicas[0]}) from step {self.step}"
            if self.phases[-1] == "fetch":
                return f"kill r{self.replicas[0]} at step {self.step}, again @fetch"
            return f"kill r{self.replicas[0]}@{self.phases[0]} step {self.step}"
        if self.kind == "double":
            return (f"kill r{self.replicas[0]}@{self.phases[0]} + r{self.replicas[1]}@{self.phases[1]} "
                    f"step {self.step}")
        if self.kind == "hang":
            return f"hang r{self.replicas[0]} {self.hang_s:.1f}s from step {self.step}"
        if self.kind == "rank-hang":
            return f"hang rank {self.ranks[0]} of r{self.replicas[0]} {self.hang_s:.1f}s from step {self.step}"
        if self.kind == "rank-kill":
            return f"kill rank {self.ranks[0]} of r{self.replicas[0]} at step {self.step}"
        return f"{self.kind} kill (down {self.down_s:.1f}s) at step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "describe": self.describe()}


def schedule(seed: int, replicas: int, steps: int, kinds: tuple[str, ...] = REPLICA_KINDS, count: int = 0,
             hang_s: tuple[float, float] = (6.0, 8.0), down_s: tuple[float, float] = (3.0, 5.0),
             warmup: int = 0, ranks: int = 1) -> list[Fault]:
    """A seeded list of faults, ordered by step: the same arguments always give the same list.

    ``count`` (default: one per kind) faults spread over steps [warmup, steps - 1], one per equal span; when count
    >= the number of kinds every kind appears at least once. ``double`` needs 3 replicas (a survivor), every
    replica fault 2. Kill phases are drawn from ``KILL_PHASES``; a rank fault's rank from ``range(ranks)``."""
    if replicas < 2 and any(k in REPLICA_KINDS + RANK_KINDS for k in kinds):
        raise ValueError("replica faults need at least 2 replicas (one must survive)")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be among {KINDS}: {list(kinds)}")
    kinds = tuple(k for k in kinds if not (k == "double" and replicas < 3))
    if not kinds:
        raise ValueError("no fault kind fits: 'double' needs 3 replicas")
    rng = random.Random(seed)
    count = count or len(kinds)
    order = list(kinds) if count >= len(kinds) else []
    rng.shuffle(order)
    order += [rng.choice(kinds) for _ in range(count - len(order))]
    rng.shuffle(order)
    warmup = warmup or max(3, steps // 20)
    last = max(warmup + 1, steps - 1)  # up to the last step: the end of a job is where forks hide
    span = (last - warmup) / count
    out = []
    for i, kind in enumerate(order):
        step = min(last, warmup + int((i + rng.random()) * span))
        if kind == "kill":
            phase = rng.choice(KILL_PHASES)
            if phase == "serve":
                joiner, source = rng.sample(range(replicas), 2)
                out.append(Fault("kill", step, (joiner, source), ("forward", "serve")))
            elif phase == "fetch":
                out.append(Fault("kill", step, (rng.randrange(replicas),), ("forward", "fetch")))
            else:
                out.append(Fault("kill", step, (rng.randrange(replicas),), (phase,)))
        elif kind == "double":
            a, b = rng.sample(range(replicas), 2)
            out.append(Fault("double", step, (a, b), (rng.choice(STEP_PHASES), rng.choice(STEP_PHASES))))
        elif kind == "hang":
            out.append(Fault("hang", step, (rng.randrange(replicas),), hang_s=round(rng.uniform(*hang_s), 2)))
        elif kind in RANK_KINDS:
            stop = round(rng.uniform(*hang_s), 2) if kind == "rank-hang" else 0.0
            out.append(Fault(kind, step, (rng.randrange(replicas),), hang_s=stop, ranks=(rng.randrange(ranks),)))
        else:
            out.append(Fault(kind, step, down_s=round(rng.uniform(*down_s), 2)))
    return out

