"""Checks of a local cluster's run (its report and the replicas' progress lines), shared by the end-to-end
tests."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def progress(tmp: pathlib.Path, replica: int) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / f"replica{replica}.progress.jsonl").read_text().splitlines()]


def check_converged(report: dict[str, Any], steps: int) -> None:
    finals = report["final"]
    assert all(f is not None and f["step"] == steps for f in finals.values()), finals
    hashes = {f["param_hash"] for f in finals.values()}
    assert len(hashes) == 1, f"replicas diverged: {finals}"


def check_survivor(tmp: pathlib.Path, replica: int, steps: int) -> None:
    """A survivor commits every step exactly once, in order, with a finite loss."""
    rows = [x for x in progress(tmp, replica) if x["event"] == "step"]
    assert [x["step"] for x in rows] == list(range(steps))
    assert all(x["loss"] is not None and x["loss"] == x["loss"] and x["loss"] < 20 for x in rows)
    assert len({x["incarnation"] for x in rows}) == 1


def committed(tmp: pathlib.Path, replicas: int) -> dict[int, dict[str, Any]]:
    """Step -> a row of it, in the lineage that survived: a resume from a checkpoint of step R at time T drops
    the rows of steps >= R written before T (that work was lost with every replica). Every remaining row of one
    step, from any replica and incarnation, must say the same batches were trained."""
    rows = [x for r in range(replicas) for x in progress(tmp, r)]
    resumes = [(x["resumed_from"], x["t"]) for x in rows if x["event"] == "start" and x.get("resumed_from") is not None]
    out: dict[int, dict[str, Any]] = {}
    for x in rows:
        if x["event"] != "step" or x.get("joined"):
            continue
        if any(x["step"] >= step and x["t"] < t for step, t in resumes):
            continue
        old = out.setdefault(x["step"], x)
        assert old["batches"] == x["batches"], f"step {x['step']}: rows disagree: {old} vs {x}"
    return out


def check_exactly_once(tmp: pathlib.Path, replicas: int, steps: int) -> dict[int, int]:
    """Every batch of every slot was trained exactly once, in order, with no gap: per slot, the batch indices of
    the committed steps are 0, 1, 2, ... Returns batches trained per slot."""
    rows = committed(tmp, replicas)
    assert sorted(rows) == list(range(steps)), "a committed step is missing"
    seen: dict[int, list[int]] = {r: [] for r in range(replicas)}
    for step in range(steps):
        for slot, index in rows[step]["batches"]:
            seen[slot].append(index)
    for slot, indices in seen.items():
        assert indices == list(range(len(indices))), f"slot {slot}: batches {indices} (a batch skipped or repeated)"
    return {slot: len(v) for slot, v in seen.items()}


def check_rejoined(tmp: pathlib.Path, replica: int, report: dict[str, Any]) -> None:
    rows = [x for x in progress(tmp, replica) if x["event"] == "step"]
    assert len({x["incarnation"] for x in rows}) >= 2, "the killed replica never came back"
    joined = [x for x in rows if x.get("joined")]
    assert joined and joined[-1]["loss"] is None  # a zero-gradient step: it received the state instead
    assert any(e["event"] == "exit" and e["replica"] == replica and e["killed"] for e in report["events"])
