"""The invariant checks of a run (``fthsdp.testing.invariants``) on hand-made runs: they hold on a clean run, a
rejoin and a resume, and catch what they claim to (divergence, lost steps, repeats, epochs going back)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fthsdp.testing import invariants as inv
from fthsdp.testing.progress import ProgressRow


def _run_rows(steps: int, replicas: int = 2) -> inv.Rows:
    """A clean run: every replica one incarnation, committing every step with every slot's batch."""
    return {r: [ProgressRow("start", 0.0, replica=r, incarnation=f"i{r}")]
            + [ProgressRow("step", 1.0 + s, replica=r, incarnation=f"i{r}", step=s, loss=1.0,
                           batches=[[x, s] for x in range(replicas)]) for s in range(steps)]
            for r in range(replicas)}


def _report(replicas: int, steps: int, epochs: list[int], hashes: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"final": {str(r): {"step": steps, "param_hash": (hashes or ("h",) * replicas)[r]}
                      for r in range(replicas)},
            "events": [{"t": float(i), "event": "epoch", "epoch": e, "members": ["a"]} for i, e in enumerate(epochs)]}


def test_invariants_hold_on_a_clean_run() -> None:
    rows = _run_rows(5)
    assert inv.check_run(_report(2, 5, [1, 2]), rows, 5) == []


def test_invariants_catch_divergence_lost_steps_repeats_and_epochs_going_back() -> None:
    steps = 6
    assert inv.converged(_report(2, steps, [1], ("a", "b")), steps)  # diverged
    rows = _run_rows(steps)
    for r in rows.values():  # step 3 lost everywhere
        r[:] = [x for x in r if x.step != 3]
    assert any("lost committed step" in v for v in inv.no_lost_step(rows, steps))
    assert inv.exactly_once(rows, steps)[1]
    rows = _run_rows(steps)
    rows[0][3] = dataclasses.replace(rows[0][3], batches=[[0, 1], [1, 2]])  # slot 0's batch 1 twice, 2 never
    assert inv.exactly_once(rows, steps)[1]
    rows = _run_rows(steps)
    rows[1].insert(4, rows[1][2])  # replica 1 commits step 1 again: it went backwards
    assert any("went backwards" in v for v in inv.no_lost_step(rows, steps))
    assert inv.epochs_increasing(_report(2, steps, [1, 2, 2]))
    seen = {"events": [{"t": 1.0, "event": "epoch_seen", "epoch": 5, "members": None},
                       {"t": 2.0, "event": "epoch_seen", "epoch": 4, "members": None}]}
    assert any("went back" in v for v in inv.epochs_increasing(seen))
    reused = {"events": [{"t": 1.0, "event": "epoch", "epoch": 5, "members": ["a"]},
                         {"t": 2.0, "event": "epoch_seen", "epoch": 5, "members": ["a", "b"]}]}
    assert any("reused" in v for v in inv.epochs_increasing(reused))


def test_invariants_accept_a_rejoin_and_a_resume() -> None:
    steps = 6
    rows = _run_rows(steps)
    # Replica 1 dies after step 2 and comes back joining at step 4 (a zero-gradient step), then trains on.
    rows[1] = [x for x in rows[1] if (x.step or 0) <= 2]
    rows[1].append(ProgressRow("start", 5.5, replica=1, incarnation="j"))
    rows[1] += [ProgressRow("step", 1.0 + s, replica=1, incarnation="j", step=s, loss=None if s == 4 else 1.0,
                            joined=s == 4, batches=[[0, s], [1, s]]) for s in (4, 5)]
    assert inv.check_run(_report(2, steps, [1, 2, 3]), rows, steps) == []
    assert inv.rejoined(rows[1], 1, {"events": [{"event": "exit", "replica": 1, "killed": True}]}) == []
