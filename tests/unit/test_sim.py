"""The effective-training-time simulator (``fthsdp.bench.sim``): the paper's figures with fixed arrivals, convergence
of Poisson arrivals to the documented limit, and bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fthsdp.bench.sim import SimConfig, closed_form, simulate

# FT-HSDP (arXiv 2602.00277): ~98K GPUs as 12 replicas, a failure every 18 minutes, a 10-minute whole-job
# recovery; FT-HSDP: 3 minutes of stall, the failed replica back after about 10 minutes.
PAPER: dict[str, Any] = dict(gpus=12 * 8192, replica_gpus=8192, mtbf_min=18.0, sync_recovery_min=10.0, stall_min=3.0,
             rejoin_min=10.0)


def test_fixed_arrivals_reproduce_the_paper_and_equal_the_closed_form() -> None:
    r = simulate(SimConfig(**PAPER, arrivals="fixed", hours=100))
    assert abs(r.sync.ett - 0.44) < 0.01
    assert abs(r.fthsdp.ett - 0.80) < 0.01
    assert r.sync.ett == pytest.approx(r.sync.closed_form_fixed, abs=1e-12)
    assert r.fthsdp.ett == pytest.approx(r.fthsdp.closed_form_fixed, abs=1e-12)


def test_poisson_arrivals_converge_to_the_documented_limit() -> None:
    limits = closed_form(SimConfig(**PAPER))
    short = simulate(SimConfig(**PAPER, arrivals="poisson", hours=50, seed=1))
    long = simulate(SimConfig(**PAPER, arrivals="poisson", hours=20000, seed=1))
    for mode in ("sync", "fthsdp"):
        limit = limits[f"{mode}_poisson_limit"]
        assert abs(getattr(long, mode).ett - limit) < 0.005, (mode, getattr(long, mode).ett, limit)
        assert abs(getattr(long, mode).ett - limit) <= abs(getattr(short, mode).ett - limit) + 0.005
    # Failures that land during a recovery share its downtime, so random arrivals lose less than evenly spaced
    # ones (exp(-x) >= 1 - x): most visibly for whole-job restarts, whose recovery is long.
    assert long.sync.ett > limits["sync_fixed"] + 0.1 and long.fthsdp.ett > limits["fthsdp_fixed"]
    assert limits["sync_poisson_limit"] == pytest.approx(math.exp(-10 / 18))


def test_recovery_longer_than_the_gap_means_no_training() -> None:
    r = simulate(SimConfig(**{**PAPER, "sync_recovery_min": 30.0}, hours=10))
    assert r.sync.ett == 0.0


@pytest.mark.parametrize("bad", [dict(replica_gpus=1000), dict(mtbf_min=0.0), dict(stall_min=-1.0),
                                 dict(arrivals="weibull")])
def test_bad_input_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SimConfig(**{**PAPER, **bad})
