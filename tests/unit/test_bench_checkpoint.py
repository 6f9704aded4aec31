"""``fthsdp bench checkpoint``'s arithmetic (``fthsdp.bench.checkpoint.step_ratio``): which steps are during a
checkpoint, and bad settings refused before anything runs."""

from __future__ import annotations

import pytest

from fthsdp.bench.checkpoint import bench_checkpoint, step_ratio


def test_the_windows_start_at_the_step_a_checkpoint_is_taken_at() -> None:
    # every 5: checkpoints as steps 4, 9, 14 commit; window 1 -> steps 4-5, 9-10, 14-15 are during one.
    rows = [(s, 2.0 if s in (4, 9, 14) else 1.5 if s in (5, 10, 15) else 1.0) for s in range(17)]
    during, steady, n = step_ratio(rows, every=5, window=1, warmup=2)
    assert (during, steady, n) == (pytest.approx(1.75), 1.0, 3)


def test_the_warm_up_counts_for_nothing() -> None:
    rows = [(s, 9.0 if s < 3 else 1.0) for s in range(12)]
    during, steady, n = step_ratio(rows, every=4, window=1, warmup=3)
    assert (during, steady, n) == (1.0, 1.0, 3)  # checkpoints as steps 3, 7 and 11 commit; steps 0-2 left out


def test_too_few_steps_on_either_side_is_an_error() -> None:
    with pytest.raises(ValueError, match="in and out"):
        step_ratio([(s, 1.0) for s in range(4)], every=10, window=2, warmup=0)


@pytest.mark.parametrize(("kw", "what"), [({"every": 1}, "--every"), ({"window": 10}, "--window"),
                                          ({"steps": 20}, "--steps"), ({"rounds": 0}, "--rounds")])
def test_bad_settings_are_refused_before_anything_runs(kw: dict[str, int], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        bench_checkpoint(**kw)  # type: ignore[arg-type]
