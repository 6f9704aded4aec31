"""The invariants of docs/design.md §8 that the membership layer carries, checked over one simulated run's
history (pure functions of what the run recorded):

- 2: epoch numbers strictly increase and are never reused for another membership, across restarts on a durable
  store; on an in-memory one, every epoch published is above every epoch a live process saw (else it ignores it);
- the split-brain guard: every epoch has at least ``min_replicas`` members (until a member left the job
  finished), one of them active;
- an incarnation is over for good once dropped: in no later epoch on the same store, nor, once it saw itself
  dropped, in any later epoch;
- 7: a replica no fault targeted runs as one incarnation from start to end and never exits before it;
- 5: no hang: at the end the lighthouse's epoch has every replica, active, and every replica's process knows it;
  then every group finishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fthsdp.chaos.sim.cluster import Exit
from fthsdp.chaos.sim.lighthouse import Published


def epochs_increase(published: Sequence[Published], lives: Sequence[bool]) -> list[str]:
    """Strictly increasing within each chain of lives joined by durable restarts; one membership per number."""
    out: list[str] = []
    high: Published | None = None
    by_number: dict[int, Published] = {}
    for e in published:
        if high is not None and not same_chain(lives, high.life, e.life):
            high, by_number = None, {}  # an in-memory restart between: numbering goes on from what members claim
        if high is not None and e.number <= high.number:
            out.append(f"epoch {e.number} at {e.t:.3f}s after epoch {high.number} at {high.t:.3f}s")
        old = by_number.get(e.number)
        if old is not None and old.members != e.members:
            out.append(f"epoch {e.number} reused at {e.t:.3f}s for another membership")
        by_number.setdefault(e.number, e)
        high = e if high is None or e.number > high.number else high
    return out


def guard_holds(published: Sequence[Published], min_replicas: int) -> list[str]:
    return [f"epoch {e.number} at {e.t:.3f}s has {len(e.members)} member(s), below min_replicas {min_replicas}, "
            f"or no active one" for e in published
            if (len(e.members) < min_replicas and not e.finished)
            or not any(role == "active" for _, _, role in e.members)]


def same_chain(lives: Sequence[bool], a: int, b: int) -> bool:
    """Whether lighthouse lives ``a`` <= ``b`` share their store (every restart between was durable)."""
    return all(lives[k] for k in range(a + 1, b + 1))


def over_for_good(published: Sequence[Published], departed: dict[tuple[str, str], tuple[float, int]],
                  lives: Sequence[bool], dropped_seen: dict[tuple[str, str], float]) -> list[str]:
    """An incarnation the lighthouse dropped is in no later epoch of a life on the same store; one that saw an
    epoch drop it is in no later epoch at all (an in-memory lighthouse forgets whom it dropped; the incarnation
    itself knows)."""
    out = []
    for e in published:
        for rid, inc, _ in e.members:
            gone = departed.get((rid, inc))
            if gone is not None and gone[0] < e.t and same_chain(lives, gone[1], e.life):
                out.append(f"{rid}/{inc} dropped at {gone[0]:.3f}s is in epoch {e.number} at {e.t:.3f}s")
            seen = dropped_seen.get((rid, inc))
            if seen is not None and seen < e.t:
                out.append(f"{rid}/{inc} saw itself dropped at {seen:.3f}s and is in epoch {e.number} at "
                           f"{e.t:.3f}s")
    return out


def only_failed_pays(exits: Sequence[Exit], replicas: int, targets: set[int], end_s: float) -> list[str]:
    return [f"r{x.replica} ({x.incarnation}) exited at {x.t:.3f}s ({x.why}) though no fault targeted it"
            for x in exits if x.replica not in targets and (not x.finished or x.t < end_s) and x.replica < replicas]


def no_hang(at_end: dict[str, object], replicas: int) -> list[str]:
    """At the end: one epoch with every replica active, known to every replica's live process."""
    if not at_end.get("lighthouse_up"):
        return ["the lighthouse is down at the end"]
    members = at_end.get("members") or {}
    processes = at_end.get("processes") or {}
    assert isinstance(members, dict) and isinstance(processes, dict)
    out = []
    for i in range(replicas):
        rid, p = f"r{i}", processes.get(i)
        mine = members.get(rid)
        if p is None:
            out.append(f"{rid} has no live process at the end")
        elif mine is None or mine != (p["inc"], "active"):
            out.append(f"{rid} ({p['inc']}) is not active in the lighthouse's epoch {at_end.get('epoch')} at the "
                       f"end: {mine}")
        elif p["known"] != at_end.get("epoch"):
            out.append(f"{rid} ({p['inc']}) knows epoch {p['known']}, the lighthouse has {at_end.get('epoch')}")
    return out


def one_final_state(states: dict[str, tuple[int, int]], total_steps: int) -> list[str]:
    """Every replica that ended the job (its barrier) holds all ``total_steps`` steps and the same state (with
    the per-step check at every commit: invariants 1 and 3, and no two final states)."""
    out = [f"{inc} finished at step {step}, not {total_steps}" for inc, (step, _) in states.items()
           if step != total_steps]
    if len({h for _, h in states.values()}) > 1:
        out.append(f"{len({h for _, h in states.values()})} final states among {sorted(states)}")
    return out


@dataclass(frozen=True)
class History:
    """What one incarnation applied, for ``histories_agree``."""

    inc: str
    steps: Mapping[int, object]
    """Step -> what its commit applied."""
    at: Mapping[int, float]
    """Step -> when it committed it."""
    died: bool
    """It exited without finishing the job."""
    dropped_at: float | None
    """When the lighthouse dropped it, if it did (a replica cut off from the lighthouse learns it late)."""


def histories_agree(histories: Sequence[History], final: Mapping[int, object] | None) -> list[str]:
    """Invariant 1 over the run: every incarnation applied the job's step t (``final``: the history the replicas
    ended the job with) whenever it applied a step t as a replica of the job. Not as one: the last step of an
    incarnation that died right after it (a replica killed mid-exchange may commit a step its partners then redo
    without it: that state died with it), and the steps an incarnation committed after the lighthouse had
    dropped it (alone in the epoch it knows and cut off from the lighthouse, it trains on until it learns it;
    that state dies with it, as it must)."""
    if final is None:
        return []
    out = []
    for h in histories:
        last = max(h.steps, default=-1)
        for t, record in sorted(h.steps.items()):
            if t not in final or record == final[t] or (h.died and t == last):
                continue
            if h.dropped_at is not None and h.at.get(t, 0.0) > h.dropped_at:
                continue
            out.append(f"{h.inc} applied step {t} as {record}, the job as {final[t]}")
            break
    return out


def finished(done: Sequence[bool]) -> list[str]:
    return [f"r{i} never finished" for i, d in enumerate(done) if not d]
