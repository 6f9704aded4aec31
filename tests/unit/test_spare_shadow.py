"""A spare's step clock (``fthsdp.runtime.spares.Shadow``): whether a slot handed over now is early enough in the
step for the spare to train that step itself (``FTHSDP_SPARE_EARLY``); and the slot a spare lends itself to warm up."""

from __future__ import annotations

import time
from unittest import mock

import pytest

from fthsdp.runtime import spares


def _at(t: float) -> mock._patch[mock.MagicMock]:
    return mock.patch.object(time, "perf_counter", return_value=t)


def test_no_step_measured_yet_is_never_early() -> None:
    s = spares.Shadow()
    assert not s.early(1.0)
    with _at(10.0):
        s.committed()  # the first commit only starts the clock: the time before it was no step of a spare
        assert not s.early(1.0)


def test_early_is_a_fraction_of_the_median_step_since_the_last_commit() -> None:
    s = spares.Shadow()
    for t in (10.0, 11.0, 12.0, 15.0):  # steps of 1, 1 and 3 s: median 1 s
        with _at(t):
            s.committed()
    with _at(15.2):
        assert s.early(0.25) and not s.early(0.1)
    with _at(15.3):
        assert not s.early(0.25) and s.early(1.0)
    with _at(15.0):
        assert not s.early(0.0)  # 0: never
    with _at(15.3):  # what a late hand-over's log line reports
        assert s.since() == pytest.approx(0.3) and s.median() == 1.0


def test_before_two_commits_there_is_no_median() -> None:
    s = spares.Shadow()
    assert s.since() == 0.0 and s.median() is None


def test_a_spare_lends_itself_slot_0_for_a_warm_up_only() -> None:
    from types import SimpleNamespace

    from fthsdp.runtime.catching_up import lent_slot
    from lighthouse.model import NO_SLOT

    spare, holder = SimpleNamespace(slot=NO_SLOT), SimpleNamespace(slot=2)
    with lent_slot(spare), lent_slot(holder):  # type: ignore[arg-type]
        assert (spare.slot, holder.slot) == (0, 2)
    assert (spare.slot, holder.slot) == (NO_SLOT, 2)
    with pytest.raises(ValueError), lent_slot(spare):  # type: ignore[arg-type]
        raise ValueError("the closure failed")
    assert spare.slot == NO_SLOT
