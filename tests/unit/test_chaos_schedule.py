"""The chaos schedule generator (pure, seeded): deterministic per seed, covers every kind and phase, well-formed
faults, never a double kill without a survivor; and the faults' descriptions."""

from __future__ import annotations

import json

import pytest

from fthsdp.chaos.schedule import (
    HA_KINDS,
    KILL_PHASES,
    KINDS,
    RANK_KINDS,
    REPLICA_KINDS,
    STEP_PHASES,
    Fault,
    schedule,
)
from fthsdp.runtime.faults import PHASES


def test_schedule_is_deterministic_for_a_seed() -> None:
    for seed in range(20):
        assert schedule(seed, 3, 400, KINDS, 8) == schedule(seed, 3, 400, KINDS, 8)
    assert len({tuple(schedule(seed, 3, 400, KINDS, 8)) for seed in range(20)}) == 20


def test_schedule_covers_every_kind_and_phase() -> None:
    for seed in range(30):
        faults = schedule(seed, 3, 400, KINDS, len(KINDS))
        assert sorted(f.kind for f in faults) == sorted(KINDS)
    phases = {f.phases[-1] for seed in range(200) for f in schedule(seed, 3, 400, ("kill",), 3)}
    assert phases == set(KILL_PHASES)
    default = schedule(0, 3, 400)
    assert sorted(f.kind for f in default) == sorted(REPLICA_KINDS)


def test_schedule_faults_are_well_formed() -> None:
    late = 0
    for seed in range(100):
        faults = schedule(seed, 3, 300, KINDS, 10, hang_s=(6.0, 8.0), down_s=(3.0, 5.0), ranks=2)
        steps = [f.step for f in faults]
        assert steps == sorted(steps) and steps[0] > 0 and steps[-1] <= 299
        late += steps[-1] >= 285  # the end of a job is drawn too (the last 5% of the steps)
        for f in faults:
            assert all(0 <= r < 3 for r in f.replicas)
            if f.kind == "double":
                assert len(set(f.replicas)) == 2 and all(p in STEP_PHASES for p in f.phases)
            elif f.kind == "kill" and f.phases[-1] == "serve":
                assert len(set(f.replicas)) == 2 and f.phases == ("forward", "serve")
            elif f.kind == "kill":
                assert len(f.replicas) == 1 and f.phases[-1] in KILL_PHASES
            elif f.kind == "hang":
                assert len(f.replicas) == 1 and 6.0 <= f.hang_s <= 8.0
            elif f.kind in RANK_KINDS:
                assert len(f.replicas) == 1 and len(f.ranks) == 1 and 0 <= f.ranks[0] < 2
                assert (6.0 <= f.hang_s <= 8.0) if f.kind == "rank-hang" else f.hang_s == 0.0
            else:
                assert f.kind in HA_KINDS and not f.replicas and 3.0 <= f.down_s <= 5.0
    assert late >= 10, late


def test_schedule_never_plans_a_double_kill_without_a_survivor() -> None:
    assert all(f.kind != "double" for seed in range(50) for f in schedule(seed, 2, 300, REPLICA_KINDS, 6))
    with pytest.raises(ValueError):
        schedule(0, 2, 300, ("double",))
    with pytest.raises(ValueError):
        schedule(0, 1, 300, ("kill",))
    with pytest.raises(ValueError):
        schedule(0, 3, 300, ("meteor",))


def test_fault_describe_is_readable() -> None:
    assert Fault("kill", 5, (1,), ("vote",)).describe() == "kill r1@vote step 5"
    assert "hang r2" in Fault("hang", 9, (2,), hang_s=6.5).describe()
    assert Fault("rank-hang", 9, (2,), hang_s=30.0, ranks=(1,)).describe() == "hang rank 1 of r2 30.0s from step 9"
    assert Fault("rank-kill", 4, (0,), ranks=(1,)).describe() == "kill rank 1 of r0 at step 4"


def test_rank_faults_are_drawn_only_when_asked_for() -> None:
    assert not any(f.kind in RANK_KINDS for seed in range(50) for f in schedule(seed, 3, 300))
    drawn = {(f.kind, f.ranks[0]) for seed in range(50) for f in schedule(seed, 3, 300, RANK_KINDS, 4, ranks=2)}
    assert drawn == {(k, r) for k in RANK_KINDS for r in (0, 1)}


def test_kill_phases_are_the_fault_hooks_phases() -> None:
    assert KILL_PHASES == PHASES
    assert set(STEP_PHASES) < set(PHASES) and "serve" not in STEP_PHASES and "fetch" not in STEP_PHASES
    # A schedule is JSON (the run's result): its phases are plain strings there.
    assert json.loads(json.dumps(schedule(3, 3, 400, ("kill", "double"), 6)[0].to_json()))["kind"] in KINDS


def test_a_fault_at_a_phase_no_replica_passes_is_refused() -> None:
    """A kill armed at an unknown phase would never fire: refused when the fault is made."""
    with pytest.raises(ValueError, match="phases \\['compute'\\] are not among"):
        Fault("kill", 5, (1,), ("compute",))
    with pytest.raises(ValueError, match="fault kind 'explode'"):
        Fault("explode", 5, (1,))
