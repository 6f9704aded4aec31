"""The blame after a failed collective (``ftar.blame``), against a fake epoch store and lighthouse: an early report
of the members still missing lets the lighthouse confirm a dead one at once, a live member that checks in late is
never reported, and a crowd of missing members waits for the grace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ftar.blame import EARLY_REPORT_MAX, EARLY_REPORT_S, blame_failure
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, Endpoints, EpochMember


def epoch(number: int, ids: tuple[str, ...]) -> EpochView:
    members = tuple(EpochMember(rid, f"{rid}-1", ACTIVE, 1, Endpoints()) for rid in ids)
    return EpochView("job", number, members, f"store/epoch{number}", 0.0, "test")


class FakeGroup:
    """The failed exchange's group: check-ins on its store, some arriving late."""

    def __init__(self, rank: int, present: set[int], late: dict[int, float] | None = None) -> None:
        self.rank = rank
        self._present = set(present)
        self._late = late or {}
        self._t0 = time.monotonic()

    def failure_key(self) -> str:
        return "failed/1"

    def check_in(self, key: str) -> None:
        self._t0 = time.monotonic()

    def present(self, key: str) -> set[int]:
        now = time.monotonic() - self._t0
        return self._present | {r for r, at in self._late.items() if now >= at}


class FakeLighthouse:
    """Confirms a report, early or not, about a member in ``dead`` by pushing an epoch without it."""

    def __init__(self, current: EpochView, dead: set[str]) -> None:
        self.replica_id = "r0"
        self.epoch = current
        self.dead = dead
        self.reports: list[tuple[str, int, bool, float]] = []
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def current(self) -> EpochView | None:
        return self.epoch

    def report(self, suspect: str, epoch_number: int, reason: str, *, early: bool = False) -> None:
        with self._lock:
            self.reports.append((suspect, epoch_number, early, time.monotonic() - self._t0))
            if suspect in self.dead and epoch_number == self.epoch.number:
                self.epoch = epoch(self.epoch.number + 1, tuple(x for x in self.epoch.replica_ids
                                                                if x != suspect))


def run(group: FakeGroup, lh: FakeLighthouse, e: EpochView, grace: float = 5.0) -> tuple[float, list[Any]]:
    logged: list[Any] = []
    log: Callable[..., None] = lambda *a: logged.append(a)  # noqa: E731
    t0 = time.monotonic()
    blame_failure(group, e, lh, 0, grace, "connection reset", log)  # type: ignore[arg-type]
    return time.monotonic() - t0, logged


def test_a_dead_member_is_reported_early_and_its_confirmation_ends_the_grace() -> None:
    e = epoch(4, ("r0", "r1", "r2"))
    lh = FakeLighthouse(e, dead={"r2"})
    took, _ = run(FakeGroup(0, {1}), lh, e)
    assert [(s, n, early) for s, n, early, _ in lh.reports] == [("r2", 4, True)]
    assert lh.reports[0][3] >= EARLY_REPORT_S
    assert took < 5.0 / 2, "the grace ran on after the lighthouse had moved on"


def test_a_live_member_that_checks_in_late_is_reported_early_only_and_never_after_the_grace() -> None:
    # r1 is live but checks in after the early report (0.1 s late); r2 never does, and no evidence confirms it.
    e = epoch(4, ("r0", "r1", "r2"))
    lh = FakeLighthouse(e, dead=set())  # nothing confirmed: the grace runs to its end
    took, _ = run(FakeGroup(0, set(), late={1: 0.1}), lh, e, grace=0.5)
    early = [s for s, _, is_early, _ in lh.reports if is_early]
    late = [s for s, _, is_early, _ in lh.reports if not is_early]
    assert early == ["r1", "r2"]
    assert late == ["r2"]  # r1 checked in within the grace: only the missing one is reported when it ends
    assert took >= 0.5


def test_a_crowd_of_missing_members_is_not_reported_early() -> None:
    ids = tuple(f"r{i}" for i in range(EARLY_REPORT_MAX + 2))
    e = epoch(2, ids)
    lh = FakeLighthouse(e, dead=set())
    run(FakeGroup(0, set()), lh, e, grace=0.2)
    assert [early for *_, early, _ in lh.reports] == [False] * (len(ids) - 1)


def test_everyone_checked_in_asks_for_a_re_formed_epoch_without_early_reports() -> None:
    e = epoch(3, ("r0", "r1"))
    lh = FakeLighthouse(e, dead=set())
    _, logged = run(FakeGroup(0, {1}), lh, e)
    assert [(s, early) for s, _, early, _ in lh.reports] == [("r1", False)]
    assert any("every member checked in" in str(x) for x in logged)


def test_after_another_death_formed_the_epoch_a_second_dead_member_is_still_reported_early() -> None:
    # r1 and r2 died at once; another member's report of r1 formed epoch 5, which still holds r2. The grace ends
    # at once (the lighthouse moved on), and r2, still in the new epoch, is reported early (its own evidence
    # confirms it); r1, already gone, is not reported.
    e4 = epoch(4, ("r0", "r1", "r2"))
    lh = FakeLighthouse(e4, dead=set())
    lh.epoch = epoch(5, ("r0", "r2"))  # pushed before this member's grace began
    run(FakeGroup(0, set()), lh, e4)
    assert [(s, n, early) for s, n, early, _ in lh.reports] == [("r2", 4, True)]
