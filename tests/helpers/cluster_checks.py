"""Checks of a local cluster's run (its report and the replicas' progress lines), shared by the end-to-end
tests: asserting wrappers over ``fthsdp.testing.invariants`` (which returns violations instead of asserting)."""

from __future__ import annotations

import pathlib
from typing import Any

from fthsdp.launch.progress import ProgressRow, progress_path, read_progress
from fthsdp.testing import invariants as inv


def progress(tmp: pathlib.Path, replica: int) -> list[ProgressRow]:
    path = progress_path(tmp, replica)
    assert path.exists(), f"no progress file {path}"
    return read_progress(path)


def _all(tmp: pathlib.Path, replicas: int) -> inv.Rows:
    return {r: progress(tmp, r) for r in range(replicas)}


def _ok(violations: list[str]) -> None:
    assert not violations, "\n".join(violations)


def check_converged(report: dict[str, Any], steps: int) -> None:
    _ok(inv.converged(report, steps))


def check_survivor(tmp: pathlib.Path, replica: int, steps: int) -> None:
    """A survivor commits every step exactly once, in order, with a finite loss."""
    _ok(inv.survivor(progress(tmp, replica), steps))


def check_exactly_once(tmp: pathlib.Path, replicas: int, steps: int) -> dict[int, int]:
    """Every batch of every slot was trained exactly once, in order, with no gap. Returns batches trained per
    slot."""
    trained, problems = inv.exactly_once(_all(tmp, replicas), steps)
    _ok(problems)
    return trained


def check_rejoined(tmp: pathlib.Path, replica: int, report: dict[str, Any]) -> None:
    _ok(inv.rejoined(progress(tmp, replica), replica, report))


def check_only_failed_pays(tmp: pathlib.Path, report: dict[str, Any], replicas: int, steps: int) -> set[int]:
    """Invariant 7: every replica that no fault of the run targeted (the launcher's kills, the chaos runner's
    replica faults: ``fthsdp.testing.invariants.fault_targets``) never exited, restarted, rolled back or fell a
    step behind. Returns the targets (a test can assert some replica was left to check)."""
    targets = inv.fault_targets(report)
    _ok(inv.only_failed_pays(_all(tmp, replicas), report, steps, targets))
    return targets


def check_all(tmp: pathlib.Path, report: dict[str, Any], replicas: int, steps: int) -> None:
    """Every invariant of ``fthsdp.testing.invariants.check_run``."""
    _ok(inv.check_run(report, _all(tmp, replicas), steps))
