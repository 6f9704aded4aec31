"""A chaos run's fail-slow flags are violations: no chaos fault makes a replica slow."""

from __future__ import annotations

from fthsdp.chaos.report import fail_slow_violations


def test_no_flag_no_violation() -> None:
    assert fail_slow_violations([]) == []


def test_each_named_replica_is_one_violation_with_its_first_evidence() -> None:
    named = [{"t": 1.0, "replica": "replica-2", "text": "replica-2 is 1.60x slower than the others since step 40"},
             {"t": 1.1, "replica": "replica-2", "text": "replica-2 is 1.70x slower than the others since step 40"},
             {"t": 2.0, "replica": "replica-0", "text": "replica-0 is 1.50x slower than the others since step 90"}]
    out = fail_slow_violations(named)
    assert len(out) == 2
    assert out[0].startswith("fail-slow: replica-0 named") and "since step 90" in out[0]
    assert out[1].startswith("fail-slow: replica-2 named") and "1.60x" in out[1]
