"""``fthsdp bench catchup`` on a small state: its figures come from a real fetch and a real socket copy, the
source's steps are split into steady and serving ones, and bad input is refused before anything starts."""

from __future__ import annotations

import pytest

from fthsdp.bench.catchup import PIECE_FLOATS, bench_catchup, cores, synthetic_state

pytestmark = pytest.mark.timeout(180)


def test_the_synthetic_state_has_the_size_asked_for_in_pieces_of_at_most_4_mib() -> None:
    state = synthetic_state(10)
    assert sum(t.numel() * 4 for _, t in state) == 10_000_000
    assert all(t.numel() <= PIECE_FLOATS for _, t in state) and len(state) == 3
    assert [n for n, _ in state] == ["param/0", "param/1", "param/2"]


def test_a_small_run_reports_the_transfer_and_the_serving_step_against_their_baselines() -> None:
    r = bench_catchup(mb=8, model="tiny", repeats=2, warmup=1, steady=3)
    doc = r.to_json()
    assert {"mb", "transfer_ratio", "serve_step_ratio"} <= set(doc) and doc["benchmark"] == "catchup"
    assert r.mb == 8 and r.bytes == 8_000_000
    assert len(r.fetch_mbps_all) == len(r.socket_copy_mbps_all) == 2
    assert r.transfer_mbps == max(r.fetch_mbps_all) and r.socket_copy_mbps == max(r.socket_copy_mbps_all)
    assert r.transfer_ratio == pytest.approx(r.transfer_mbps / r.socket_copy_mbps, rel=0.01)
    assert r.steady_steps >= 3 and r.serving_steps >= 1
    assert r.pinned == (cores() is not None)  # the training thread has a core of its own where there are two
    assert r.serve_step_ratio == pytest.approx(r.serving_step_s / r.steady_step_s, rel=0.01)


@pytest.mark.parametrize("kw", [{"mb": 0}, {"mb": -1}, {"repeats": 0}])
def test_bad_input_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="--mb must be positive"):
        bench_catchup(**kw)  # type: ignore[arg-type]
