"""``fthsdp bench failover``'s result: medians per arm, the headline ``failover_median_s`` (the knock arm's next
epoch at every member), the ratio against the lease, and its generated section."""

from __future__ import annotations

import pytest

from fthsdp.bench.docs import section_failover
from fthsdp.bench.failover import FailoverResult, FailoverRun, bench_failover, format_failover


def result() -> FailoverResult:
    r = FailoverResult(members=8, rounds=3, election_ttl_s=5, election_probe_s=0.25, heartbeat_timeout_s=3.0,
                       loadavg_before=0.5)
    for lead, epoch in ((0.5, 1.4), (0.6, 1.3), (0.4, 9.0)):
        r.runs.append(FailoverRun("knock", lead, lead + 0.5, epoch, 3, 4))
    for epoch in (7.0, 8.0, 7.5):
        r.runs.append(FailoverRun("lease", 4.8, 6.0, epoch, 3, 4))
    return r


def test_the_headline_is_the_knock_arms_median_next_epoch_and_the_ratio_is_over_the_lease() -> None:
    doc = result().to_json()
    assert doc["failover_median_s"] == 1.4  # the median, not the mean: one slow round does not move it
    assert doc["medians"]["knock"] == {"lead_s": 0.5, "reconnect_s": 1.0, "epoch_s": 1.4}
    assert doc["medians"]["lease"]["epoch_s"] == 7.5 and doc["ratio_epoch_s"] == round(1.4 / 7.5, 3)
    assert len(doc["runs"]) == 6 and "failover_median_s (next epoch at every member, knock): 1.40 s" in \
        format_failover(result())


def test_the_section_states_the_load_and_the_medians_per_arm() -> None:
    lines = section_failover(result().to_json(), {"failover": ["A note."]})
    assert any("1-minute load 0.5" in line for line in lines)
    assert "| knock | 0.50 s | 1.00 s | 1.40 s |" in lines and "| lease | 4.80 s | 6.00 s | 7.50 s |" in lines
    assert "A note." in lines and section_failover(None, None) == []


@pytest.mark.parametrize("kw", [{"members": 0}, {"rounds": 0}, {"election_ttl_s": 1}, {"election_probe_s": 0.0}])
def test_bad_settings_are_refused_before_anything_starts(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        bench_failover(**kw)  # type: ignore[arg-type]
