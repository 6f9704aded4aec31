"""The peer row of ``fthsdp bench lighthouse --vs torchft`` (fthsdp.bench.baselines.torchft_lighthouse): a real
torchft lighthouse and a few emulated torchft groups; a death reaches everyone only after its heartbeat timeout."""

from __future__ import annotations

import pytest

from fthsdp.bench.baselines.torchft_lighthouse import MAX_REPLICAS, bench_torchft_lighthouse

pytestmark = pytest.mark.timeout(120)


def test_a_death_reaches_every_group_after_the_heartbeat_timeout() -> None:
    row = bench_torchft_lighthouse(20, interval=0.2)
    assert "error" not in row, row
    assert row["bootstrap_s"] > 0 and row["call_errors"] == 0
    # No evidence of a death in torchft: the others learn of it only once its heartbeats are a timeout old.
    assert row["death_to_all_s"] >= row["heartbeat_timeout_s"] - row["heartbeat_interval_s"], row


def test_sizes_the_emulation_cannot_carry_are_not_run() -> None:
    row = bench_torchft_lighthouse(MAX_REPLICAS + 1, interval=1.0)
    assert "skipped" in row and "bootstrap_s" not in row
