"""What the chaos injector arms for each kind of kill (``kill_arms``, pure): every kill a schedule can draw arms
without error, at the step after its replica's last commit."""

from __future__ import annotations

import pytest

from fthsdp.chaos.injector import kill_arms
from fthsdp.chaos.schedule import Fault, schedule

STEPS = {0: 10, 1: 12, 2: 11}


def test_a_kill_at_a_phase_arms_that_phase_at_the_next_step() -> None:
    assert kill_arms(Fault("kill", 5, (1,), ("exchange",)), STEPS) == [(1, 13, "exchange")]


def test_a_fetch_kill_arms_its_first_kill_only() -> None:
    # The fetch kill itself is armed for the next incarnation once the first one fired.
    assert kill_arms(Fault("kill", 5, (2,), ("forward", "fetch")), STEPS) == [(2, 12, "forward")]


def test_a_serve_kill_arms_the_source_at_once_and_kills_the_joiner() -> None:
    assert kill_arms(Fault("kill", 5, (0, 2), ("forward", "serve")), STEPS) == [(2, 0, "serve"), (0, 11, "forward")]


def test_a_double_kill_arms_both() -> None:
    assert kill_arms(Fault("double", 5, (0, 2), ("vote", "backward")), STEPS) == [(0, 11, "vote"),
                                                                                   (2, 12, "backward")]


def test_a_replica_with_no_commit_yet_is_armed_at_step_one() -> None:
    assert kill_arms(Fault("kill", 0, (1,), ("forward",)), {}) == [(1, 1, "forward")]


def test_not_a_kill_is_refused() -> None:
    with pytest.raises(ValueError, match="not a kill"):
        kill_arms(Fault("hang", 5, (1,), (), hang_s=6.0), STEPS)


@pytest.mark.parametrize("seed", range(100))
def test_every_kill_a_default_schedule_draws_can_be_armed(seed: int) -> None:
    for f in schedule(seed, replicas=3, steps=800):
        if f.kind in ("kill", "double"):
            arms = kill_arms(f, STEPS)
            assert arms and all(r in f.replicas and phase in f.phases for r, _, phase in arms)
