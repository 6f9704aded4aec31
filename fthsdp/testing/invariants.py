"""The invariants of a run (docs/design.md §8), checked after the fact over what a local cluster leaves behind: the
replicas' progress rows (``fthsdp.launch.progress``) and the launcher's report.

Every check is a pure function over rows and the report dict and returns a list of violations (human-readable
strings; empty when the invariant holds) instead of asserting, so that the chaos runner can collect them all and
the tests can assert on them (``tests/helpers/cluster_checks.py``).

Checked here:

- converged (``fthsdp.launch.cluster.converged``, which ``fthsdp demo`` runs too): every replica finished at the last
  step with the same state hash (§8.1, at the end of the run);
- survivor: a replica that never died committed every step once, in order, with a finite loss (§8.3);
- exactly-once: in the surviving lineage every step 0..N-1 was committed, every row of one step names the same
  batches, and each slot's batches are 0, 1, 2, ... with no gap or repeat (§8.3, §8.4);
- no lost committed step: the above plus "nobody goes backwards": within one incarnation a replica's committed
  steps go up by exactly one (§8.3);
- epochs strictly increasing: the lighthouse's epoch history, and every epoch number seen while the run went on,
  never go back and are never reused (§8.2);
- only the failed replica pays: every replica that no fault targeted (``fault_targets``: the launcher's kills,
  the chaos runner's kills, hangs and double kills) ran as one incarnation from start to end and committed every
  step 0..N-1 once, in order: it never exited, restarted, rolled back or fell behind (§8.7). Unlike ``survivors``,
  which leaves out every replica that exited, this check cannot be dodged by a healthy replica sent back to rejoin.
"""

from __future__ import annotations

import pathlib
from collections.abc import Collection
from itertools import pairwise
from typing import Any

from fthsdp.launch.cluster import converged
from fthsdp.launch.progress import ProgressRow, progress_path, read_progress, steps_of

Rows = dict[int, list[ProgressRow]]
"""Replica index -> its progress rows, in file order."""


def load_run(workdir: pathlib.Path, replicas: int) -> Rows:
    return {r: read_progress(progress_path(workdir, r)) for r in range(replicas)}


# --- §8.1: bitwise-equal state ---------------------------------------------------------------------------------

# --- §8.3: survivors and committed steps ------------------------------------------------------------------------

def survivor(rows: list[ProgressRow], steps: int) -> list[str]:
    """A survivor (one incarnation all along) commits every step exactly once, in order, with a finite loss on
    every step it trained a batch in, and none on a step it did not (a spare's: ``contributed`` false)."""
    s = steps_of(rows)
    out = []
    got = [x.step for x in s if x.step is not None]
    if got != list(range(steps)):
        out.append(f"survivor's committed steps are not 0..{steps - 1} in order: {_summary(got)}")
    bad = [x.step for x in s if x.contributed and not (x.loss is not None and x.loss == x.loss and x.loss < 20)]
    if bad:
        out.append(f"survivor has steps with no or a non-finite loss: {bad[:10]}")
    idle = [x.step for x in s if not x.contributed and x.loss is not None]
    if idle:
        out.append(f"survivor has a loss on steps it trained no batch in: {idle[:10]}")
    incarnations = {x.incarnation for x in s}
    if len(incarnations) > 1:
        out.append(f"survivor ran as several incarnations: {sorted(map(str, incarnations))}")
    return out


def survivors(per_replica: Rows, report: dict[str, Any]) -> list[int]:
    """Replicas that never died: no ``exit`` event in the report, one incarnation in their progress lines."""
    died = {e["replica"] for e in report.get("events", []) if e.get("event") == "exit"}
    died |= {r for r, rows in per_replica.items()
             if len({x.incarnation for x in rows if x.event in ("start", "step")}) > 1}
    return [r for r in sorted(per_replica) if r not in died]


def committed(per_replica: Rows) -> tuple[dict[int, ProgressRow], list[str]]:
    """Step -> a row of it, in the lineage that survived, and the disagreements found.

    A resume from a checkpoint of step R at time T drops the rows of steps >= R written before T (that work was
    lost with every replica). Every remaining row of one step, from any replica and incarnation, must say the
    same batches were trained. Rows of a joiner's zero-gradient step (``joined``) name no batch of their own."""
    rows = [x for r in sorted(per_replica) for x in per_replica[r]]
    resumes = [(x.resumed_from, x.t) for x in rows if x.event == "start" and x.resumed_from is not None]
    out: dict[int, ProgressRow] = {}
    problems: list[str] = []
    for x in rows:
        if x.event != "step" or x.joined or x.step is None:
            continue
        if any(x.step >= step and x.t < t for step, t in resumes):
            continue
        old = out.setdefault(x.step, x)
        if old.batches != x.batches:
            problems.append(f"step {x.step}: rows disagree on the batches trained: {old} vs {x}")
    return out, problems


def exactly_once(per_replica: Rows, steps: int) -> tuple[dict[int, int], list[str]]:
    """Every batch of every slot was trained exactly once, in order, with no gap: per slot, the batch indices of
    the committed steps are 0, 1, 2, ... Returns (batches trained per slot, violations)."""
    rows, problems = committed(per_replica)
    missing = sorted(set(range(steps)) - set(rows))
    extra = sorted(set(rows) - set(range(steps)))
    if missing:
        problems.append(f"committed step(s) missing from the surviving lineage: {_summary(missing)}")
    if extra:
        problems.append(f"step(s) committed past the last one: {_summary(extra)}")
    seen: dict[int, list[int]] = {r: [] for r in per_replica}
    for step in sorted(rows):
        for slot, index in rows[step].batches or []:
            seen.setdefault(slot, []).append(index)
    for slot, indices in sorted(seen.items()):
        if indices != list(range(len(indices))):
            problems.append(f"slot {slot}: batches {_summary(indices)} (a batch skipped or repeated)")
    return {slot: len(v) for slot, v in seen.items()}, problems


def no_lost_step(per_replica: Rows, steps: int) -> list[str]:
    """No committed step lost, nobody going backwards: every step 0..N-1 is committed in the surviving lineage,
    and within one incarnation a replica's committed steps go up by exactly one (a commit is never undone or
    skipped by a live process); a restarted incarnation never starts behind its own previous commits unless the
    job resumed from a checkpoint (every replica died)."""
    rows, _ = committed(per_replica)
    problems = []
    missing = sorted(set(range(steps)) - set(rows))
    if missing:
        problems.append(f"lost committed step(s): {_summary(missing)}")
    resumed = any(x.event == "start" and x.resumed_from is not None for rs in per_replica.values() for x in rs)
    for r, rs in sorted(per_replica.items()):
        by_inc: dict[str | int | None, list[int]] = {}
        for x in steps_of(rs):
            if x.step is not None:
                by_inc.setdefault(x.incarnation, []).append(x.step)
        last_max = -1
        for inc, got in by_inc.items():  # in order of first appearance (the file is appended to)
            for a, b in pairwise(got):
                if b != a + 1:
                    problems.append(f"replica {r} incarnation {inc}: committed step {a} then {b} "
                                    f"({'went backwards' if b <= a else 'skipped'})")
                    break
            if got and got[0] <= last_max and not resumed:
                problems.append(f"replica {r} incarnation {inc} started at step {got[0]}, behind its own earlier "
                                f"commit of step {last_max}")
            if got:
                last_max = max(last_max, got[-1])
    return problems


def rejoined(rows: list[ProgressRow], replica: int, report: dict[str, Any]) -> list[str]:
    """A killed replica came back as a new incarnation through a zero-gradient joining step."""
    s = steps_of(rows)
    problems = []
    if len({x.incarnation for x in s}) < 2:
        problems.append(f"replica {replica} never came back")
    joined = [x for x in s if x.joined]
    if not joined or joined[-1].loss is not None:
        problems.append(f"replica {replica} has no zero-gradient joining step")
    if not any(e["event"] == "exit" and e["replica"] == replica and e["killed"] for e in report["events"]):
        problems.append(f"replica {replica} was never killed")
    return problems


# --- §8.2: epochs ----------------------------------------------------------------------------------------------

def epochs_increasing(report: dict[str, Any]) -> list[str]:
    """The lighthouse's epoch history (``epoch`` events of the report) strictly increases, and the epochs seen
    while the run went on (``epoch_seen`` events, polled from the leader, as the chaos runner records them) never
    go back; across both, one number always names the same members."""
    problems = []
    history = [e for e in report.get("events", []) if e.get("event") == "epoch"]
    numbers = [e["epoch"] for e in history]
    for a, b in pairwise(numbers):
        if b <= a:
            problems.append(f"epoch history not strictly increasing: {a} then {b} (history {numbers})")
            break
    seen = sorted((e for e in report.get("events", []) if e.get("event") == "epoch_seen"), key=lambda e: e["t"])
    for a, b in pairwise(seen):
        if b["epoch"] < a["epoch"]:
            problems.append(f"epoch went back from {a['epoch']} to {b['epoch']} (seen at {a['t']:.3f} and "
                            f"{b['t']:.3f}{', lighthouse ' + str(b.get('leader')) if b.get('leader') else ''})")
    members: dict[int, list[str]] = {}
    for e in history + seen:
        if e.get("members") is None:
            continue
        got = sorted(e["members"])
        old = members.setdefault(e["epoch"], got)
        if old != got:
            problems.append(f"epoch {e['epoch']} reused for other members: {old} vs {got}")
    return problems


# --- §8.7: only the failed replica pays ------------------------------------------------------------------------

def fault_targets(report: dict[str, Any]) -> set[int]:
    """The replicas the run's faults were aimed at, from the report's events: the launcher's kills (a ``start``
    event whose incarnation had a kill armed, ``fault``) and every replica a fault injected by the chaos runner
    names (``chaos`` events: a kill's, a hang's, both of a double kill's, the joiner and the source of a serve
    kill). A lighthouse or etcd kill names no replica."""
    out: set[int] = set()
    for e in report.get("events", []):
        if e.get("event") == "start" and e.get("fault"):
            out.add(int(e["replica"]))
        elif e.get("event") == "chaos":
            out.update(int(r) for r in e["fault"].get("replicas", ()))
    return out


def only_failed_pays(per_replica: Rows, report: dict[str, Any], steps: int, targets: Collection[int]) -> list[str]:
    """Invariant 7 over every replica not in ``targets``: it never exited (no ``exit`` event in the report), never
    restarted (one incarnation; no ``start`` row registering as joining after its first), never rolled back (its
    committed steps go up by exactly one, none repeated) and never fell behind (it committed every step
    0..N-1 and reached the last one)."""
    exits: dict[int, list[Any]] = {}
    for e in report.get("events", []):
        if e.get("event") == "exit":
            exits.setdefault(int(e["replica"]), []).append(e.get("code"))
    out = []
    for r in sorted(set(per_replica) - set(targets)):
        rows = per_replica[r]
        who = f"replica {r} (no fault targeted it)"
        if r in exits:
            out.append(f"{who} exited {len(exits[r])} time(s), status {exits[r]}")
        incarnations = list(dict.fromkeys(x.incarnation for x in rows if x.event in ("start", "step")))
        if len(incarnations) > 1:
            out.append(f"{who} restarted: ran as {len(incarnations)} incarnations {list(map(str, incarnations))}")
        starts = [x for x in rows if x.event == "start"]
        if any(x.joining for x in starts[1:]):
            out.append(f"{who} registered again as joining after its first start")
        got = [x.step for x in steps_of(rows) if x.step is not None]
        back = next(((a, b) for a, b in pairwise(got) if b <= a), None)
        if back is not None:
            out.append(f"{who} rolled back: committed step {back[0]} then {back[1]}")
        skip = next(((a, b) for a, b in pairwise(got) if b > a + 1), None)
        if skip is not None:
            out.append(f"{who} skipped: committed step {skip[0]} then {skip[1]}")
        missing = sorted(set(range(steps)) - set(got))
        if missing:
            last = f" (never reached the last step, {steps - 1})" if steps - 1 in missing else ""
            out.append(f"{who} fell behind: never committed step(s) {_summary(missing)}{last}")
    return out


# --- all of them -----------------------------------------------------------------------------------------------

def check_run(report: dict[str, Any], per_replica: Rows, steps: int) -> list[str]:
    """Every invariant over one finished run; each violation is prefixed with the invariant's name. The faults'
    targets, which invariant 7 leaves out, are read from the report (``fault_targets``)."""
    out = [f"converged: {v}" for v in converged(report, steps)]
    for r in survivors(per_replica, report):
        out += [f"survivor {r}: {v}" for v in survivor(per_replica[r], steps)]
    _, eo = exactly_once(per_replica, steps)
    out += [f"exactly-once: {v}" for v in eo]
    out += [f"no-lost-step: {v}" for v in no_lost_step(per_replica, steps)]
    out += [f"epochs: {v}" for v in epochs_increasing(report)]
    targets = fault_targets(report)
    out += [f"only-failed-pays: {v}" for v in only_failed_pays(per_replica, report, steps, targets)]
    return out


def _summary(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 20 else f"{xs[:10]} ... {xs[-5:]} ({len(xs)} in all)"

