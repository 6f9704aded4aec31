"""fthsdp.launch.recovery_metrics on synthetic progress rows (no processes)."""

from __future__ import annotations

import pytest

from fthsdp.launch.progress import ProgressRow
from fthsdp.launch.recovery_metrics import Failure, median_step, recovery_metrics, whole_job_restart_metrics


def rows(times: list[float], first_step: int = 0, incarnation: int = 1,
         joined_first: bool = False) -> list[ProgressRow]:
    return [ProgressRow("step", t, step=first_step + k, incarnation=incarnation, joined=joined_first and k == 0)
            for k, t in enumerate(times)]


def test_one_failure_stall_rejoin_and_ett() -> None:
    # Steps every 1 s; replica 1 dies at t=10.5 after committing steps 0..10; the survivors' step 11 takes 3 s
    # (a 2 s stall); the restarted replica joins at step 16 (t=17.5 + ... ) and trains to the end.
    survivor = [float(t) for t in range(0, 11)] + [13.0 + k for k in range(0, 19)]  # steps 0..29, last at t=31
    killed = rows([float(t) for t in range(0, 11)]) + rows([18.0 + k for k in range(0, 14)], first_step=16,
                                                             incarnation=2, joined_first=True)
    steps = {0: rows(survivor), 1: killed, 2: rows(survivor)}
    m = recovery_metrics(steps, [Failure(10.5, 1)], replicas=3)
    assert m["median_step_s"] == pytest.approx(1.0)
    assert m["stall_per_failure_s"] == [pytest.approx(2.0)]
    assert m["survivor_max_stall_s"] == pytest.approx(2.0)
    assert m["lost_per_failure_s"] == [pytest.approx(2.0)]
    assert m["rejoin_s"] == pytest.approx(18.0 - 10.5)
    # trained: 30 + 30 steps of the survivors, 11 + 13 of replica 1 (its joined step excluded); wall 31 s
    assert m["replica_steps_trained"] == 30 + 30 + 11 + 13
    assert m["effective_training_time"] == pytest.approx(84 * 1.0 / (3 * 31.0))


def test_warmup_excludes_early_gaps_and_incarnations_do_not_mix() -> None:
    slow_start = rows([0.0, 5.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    assert median_step({0: slow_start}, warmup=0) == pytest.approx(1.0)
    assert median_step({0: slow_start}, warmup=3) == pytest.approx(1.0)
    assert median_step({0: slow_start[:4]}, warmup=3) == pytest.approx(1.0)
    assert median_step({0: slow_start[:4]}, warmup=0) == pytest.approx(5.0)
    # A gap between two incarnations is not a step.
    two = rows([0.0, 1.0, 2.0]) + rows([100.0, 101.0], first_step=3, incarnation=2)
    assert median_step({0: two}) == pytest.approx(1.0)


def test_stalls_are_attributed_to_each_failure() -> None:
    survivor = [0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 14.0, 15.0]  # stalls of 2 s then 3 s
    steps = {0: rows(survivor), 1: rows([0.0, 1.0, 2.0]), 2: rows([0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0, 9.0])}
    m = recovery_metrics(steps, [Failure(2.5, 1), Failure(9.5, 2)], replicas=3)
    assert m["stall_per_failure_s"] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert m["rejoin_s"] is None  # nobody came back


def test_whole_job_restart_counts_lost_steps() -> None:
    # Checkpoint after step 14 (resume at 15); the kill at t=20.5 after step 19; the job resumes with step 15
    # committed at t=27.5: 7 s to new progress + 5 lost steps x 1 s.
    before = [float(t) for t in range(0, 20)]
    after = [27.5 + k for k in range(0, 45)]  # steps 15..59
    one = rows(before) + rows(after, first_step=15, incarnation=2)
    m = whole_job_restart_metrics({0: one, 1: one, 2: one}, Failure(20.5, 1), replicas=3)
    assert m["resume_s"] == pytest.approx(7.0)
    assert m["lost_steps"] == 5
    assert m["restart_from_step"] == 15
    assert m["stall_per_failure_s"] == [pytest.approx(12.0)]
    assert m["replica_steps_trained"] == 3 * 60  # a step trained twice counts once
    assert m["effective_training_time"] == pytest.approx(180 * 1.0 / (3 * (27.5 + 44)))


def test_overhead_ratio_pairs_each_run_with_its_neighbour() -> None:
    from fthsdp.bench.overhead import paired_ratios

    # the machine drifts 30% between rounds; each round's fthsdp run is 2% slower than its baseline
    ratio, ratios = paired_ratios([1.0, 1.3, 1.1], [1.02, 1.326, 1.122])
    assert ratios == pytest.approx([1.02, 1.02, 1.02]) and ratio == pytest.approx(1.02)
    assert paired_ratios([1.0, 1.0, 1.0], [1.5, 1.0, 1.1])[0] == pytest.approx(1.1)  # the median, not the mean
    with pytest.raises(ValueError, match="as many"):
        paired_ratios([1.0], [])


def test_ett_counts_the_batches_the_job_trained_where_rows_report_them() -> None:
    # Two slots, steps every 1 s. Replica 1 dies after step 3; a spare (index 2) trains slot 1 from step 5, so
    # slot 1's batch 4 is never trained. Every row lists the step's committed batches, the job's (as fthsdp's do).
    def step(k: int, t: float, slots: tuple[int, ...], contributed: bool = True, inc: int = 1) -> ProgressRow:
        return ProgressRow("step", t, step=k, incarnation=inc, contributed=contributed,
                           batches=[[s, k if s == 0 or k < 4 else k - 1] for s in slots])

    both, alone = (0, 1), (0,)
    r0 = [step(k, float(k), both if k != 4 else alone) for k in range(10)]
    r1 = [step(k, float(k), both) for k in range(4)]
    spare = [step(k, float(k), both if k != 4 else alone, contributed=k >= 5) for k in range(10)]
    m = recovery_metrics({0: r0, 1: r1, 2: spare}, [Failure(3.5, 1)], replicas=2)
    assert m["ett_basis"] == "batches"
    assert m["batches_trained"] == 10 + 9  # slot 0: batches 0..9; slot 1: 0..3 and 4..8 (its cursor lost a step)
    assert m["effective_training_time"] == pytest.approx(19 * 1.0 / (2 * 9.0))
    # Counted in replica-steps, the spare's five steps of slot 1 would be the spare's, beside two slot replicas.
    assert m["replica_steps_trained"] == 10 + 4 + 5


def test_ett_falls_back_to_replica_steps_where_rows_report_no_batches() -> None:
    m = recovery_metrics({0: rows([0.0, 1.0, 2.0]), 1: rows([0.0, 1.0, 2.0])}, [], replicas=2)
    assert (m["ett_basis"], m["batches_trained"], m["replica_steps_trained"]) == ("replica-steps", 0, 6)
    assert m["effective_training_time"] == pytest.approx(6 * 1.0 / (2 * 2.0))
