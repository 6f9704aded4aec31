"""The lighthouse's garbage-collection policy (lighthouse.server.collector): what exists is frozen at every tick, and
a full collection runs only when the job has been quiet, or when it is long overdue; and an epoch's log line of a
large job gives counts, not 10,000 names."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from lighthouse.server import collector
from lighthouse.server.collector import FULL_EVERY_S, QUIET_S, Collector, full_due
from lighthouse.server.edge import LOG_MEMBERS_UP_TO, _members_text


def test_a_full_collection_waits_for_quiet_and_for_its_period() -> None:
    assert not full_due(now=FULL_EVERY_S - 1, last_change=0.0, last_full=0.0)  # too soon, though quiet
    assert full_due(now=FULL_EVERY_S, last_change=FULL_EVERY_S - QUIET_S, last_full=0.0)  # due and quiet
    assert not full_due(now=FULL_EVERY_S, last_change=FULL_EVERY_S - 1, last_full=0.0)  # due, an epoch just changed
    assert full_due(now=2 * FULL_EVERY_S, last_change=2 * FULL_EVERY_S, last_full=0.0)  # never quiet: overdue


@pytest.fixture
def gc_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []
    monkeypatch.setattr(collector.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(collector.gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(collector.gc, "collect", lambda: calls.append("collect") or 0)
    yield calls


def test_every_tick_freezes_and_only_a_due_one_collects_first(gc_calls: list[str]) -> None:
    c = Collector(now=0.0)
    c.tick(now=1.0, last_change=0.5)
    assert gc_calls == ["freeze"]
    gc_calls.clear()
    c.tick(now=FULL_EVERY_S + QUIET_S, last_change=0.5)
    assert gc_calls == ["unfreeze", "collect", "freeze"]
    assert c.last_full == FULL_EVERY_S + QUIET_S
    gc_calls.clear()
    c.tick(now=FULL_EVERY_S + QUIET_S + 1, last_change=0.5)
    assert gc_calls == ["freeze"], "collected again right after a full collection"


def test_the_real_freeze_hides_what_exists_from_the_collector() -> None:
    c = Collector(now=0.0)
    before = gc.get_freeze_count()
    try:
        c.tick(now=1.0, last_change=0.0)
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def _members(n: int) -> tuple[EpochMember, ...]:
    return tuple(EpochMember(f"r{i}", "inc", JOINING if i == 0 else ACTIVE, 1, Endpoints()) for i in range(n))


def test_an_epochs_log_line_names_few_members_and_counts_many() -> None:
    assert _members_text(_members(2)) == "r0:joining,r1:active"
    assert _members_text(_members(LOG_MEMBERS_UP_TO + 1)) == f"{LOG_MEMBERS_UP_TO + 1} (32 active, 1 joining)"
