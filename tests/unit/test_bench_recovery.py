"""``fthsdp bench recovery``'s effective training time on one common step: its formula, that a slower step cannot
score better with it, and that the JSON's top-level ``ett_common_step`` is the one measured in the same invocation
(the side-by-side table's when there is one)."""

from __future__ import annotations

from fthsdp.bench.recovery import common_ett
from fthsdp.bench.results import RecoveryReport, RecoveryResult
from fthsdp.bench.vs import _row


def test_common_ett_is_replica_steps_on_the_common_step_over_replicas_times_wall() -> None:
    assert common_ett(170, 60.0, 3, 1.0) == round(170 * 1.0 / (3 * 60.0), 3)
    assert common_ett(170, 60.0, 3, None) is None and common_ett(170, 0.0, 3, 1.0) is None


def test_a_slower_step_scores_better_on_its_own_step_but_not_on_the_common_one() -> None:
    # Two systems train the same replica-steps; the second's step is 1.5x longer, so its run takes 1.5x the wall.
    fast = {"step_s": 1.0, "replica_steps_trained": 170, "wall_s": 60.0, "ett": round(170 * 1.0 / 180, 3)}
    slow = {"step_s": 1.5, "replica_steps_trained": 170, "wall_s": 60.0 * 1.5, "ett": round(170 * 1.5 / 270, 3)}
    assert slow["ett"] == fast["ett"]  # its own median step hides the slowdown
    a, b = _row("fast", fast, 1.0, 3), _row("slow", slow, 1.0, 3)
    assert b["ett_common_step"] < a["ett_common_step"]
    assert a["ett_common_step"] == fast["ett"]
    assert _row("none", {"step_s": 1.0}, 1.0, 3)["ett_common_step"] is None


def _result(**kw: object) -> RecoveryResult:
    base: dict[str, object] = dict(
        replicas=3, ranks_per_replica=2, steps=60, model="reference", kill="1@20:forward", restart_delay_s=2.0,
        warm_restarts=False, survivor_stall_s=0.5, catchup_step_ratio=1.0, join_s=3.0, join_from_registration_s=2.0,
        transfer_ratio=0.5, down_step_s=1.0, catchup_step_s=1.0, catchup_steps_observed=3, catchup_bytes_rank0=1,
        transfer_mbps=1.0, socket_copy_mbps=2.0, catchup={}, rejoin_s=5.0, back_to_full_s=6.0,
        effective_training_time=0.95, replica_steps_trained=170, wall_s=60.0, step_s=1.0, stall_s=0.5, ett=0.95,
        final_equal=True)
    return RecoveryResult(**{**base, **kw})  # type: ignore[arg-type]


def test_the_top_level_key_is_this_runs_own_or_the_tables() -> None:
    own = RecoveryReport(_result(common_step_s=0.9, ett_common_step=0.85)).to_json()
    assert own["ett_common_step"] == 0.85 and own["fthsdp"]["common_step_s"] == 0.9
    vs = {"table": [{"system": "fthsdp", "ett_common_step": 0.8}, {"system": "torchft", "ett_common_step": 0.7}]}
    assert RecoveryReport(_result(), vs).to_json()["ett_common_step"] == 0.8


def test_the_report_says_what_carrying_and_the_exact_sum_cost_with_the_load() -> None:
    from fthsdp.bench.results import format_recovery

    text = format_recovery(RecoveryReport(_result(
        carry_orphans=True, deterministic=True, before_step_s=0.8, down_step_ratio=1.31, deterministic_step_ratio=1.07,
        loadavg_1min=0.42)))
    assert "orphan slots carried with the exact sum (1-minute load 0.42 before)" in text
    assert "survivors' step while down            1.31   (over their step before the kill, 0.8 s; carrying" in text
    assert "exact sum's step / default sum's      1.07" in text
    plain = format_recovery(RecoveryReport(_result()))
    assert "carried" not in plain and "exact sum" not in plain


def test_the_benchmarks_run_the_lighthouse_at_its_own_defaults() -> None:
    """What a deployment runs (0.5 s heartbeats), not the test launcher's faster ones; the rest as given."""
    from fthsdp.launch.config import ClusterConfig, at_lighthouse_defaults
    from lighthouse.model import Policy

    given = ClusterConfig(replicas=4, spares=1)
    c = at_lighthouse_defaults(given)
    p = Policy()
    assert (c.heartbeat_interval_s, c.heartbeat_timeout_s, c.confirm_age_s) == \
        (p.heartbeat_interval_s, p.heartbeat_timeout_s, p.confirm_age_s) != \
        (given.heartbeat_interval_s, given.heartbeat_timeout_s, given.confirm_age_s)
    assert (c.replicas, c.spares) == (4, 1)


def test_the_restart_table_has_a_row_per_invocation_given() -> None:
    from fthsdp.bench.docs import section_warm_restarts

    def doc(rejoin: float) -> dict[str, object]:
        return {"fthsdp": {"rejoin_s": rejoin, "back_to_full_s": 1.0, "final_equal": True}}

    lines = section_warm_restarts(doc(20.0), doc(4.5), None, doc(30.0), doc(4.0))
    rows = [x for x in lines if x.startswith("| ") and x[2:5] in ("col", "war", "hot")]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "cold start", "warm standby", "hot spare (+1 group), cold restart", "hot spare (+1 group), warm standby"]
    assert [r.split(" | ")[1] for r in rows] == ["20.00", "4.50", "30.00", "4.00"]
    assert len(section_warm_restarts(doc(20.0), None, None)) > 0 and section_warm_restarts(None, None, None) == []


def test_the_lanes_table_has_a_row_per_size_and_counts_errors() -> None:
    from fthsdp.bench.docs import section_lanes

    def way(on: str, calls: float, errors: list[str]) -> dict[str, object]:
        return {"rendezvous_on": on, "lanes_total": 8192, "lanes_sampled": 20, "members_per_lane": 11,
                "backend": "mesh", "deaths": 3, "lane_rebuild_p50_s": 0.5, "lane_rebuild_p99_s": 0.9,
                "lighthouse_calls_per_change": calls, "lighthouse_calls_per_change_projected": calls * 409.6,
                "lighthouse_cpu_s_per_change": 1.0, "lighthouse_cpu_us_per_call": 400.0 if calls else None,
                "lighthouse_rebuild_projected_s": calls * 409.6 * 4e-4 if calls else None, "errors": errors}

    doc = {"lanes": [{"replicas": 12, "ranks_per_group": 8192, "members": way("members", 0.0, []),
                      "lighthouse": way("lighthouse", 3000.0, ["x"]), "loadavg_1min": 1.5}]}
    lines = section_lanes([doc], {"lanes": ["A note."]})
    rows = [line for line in lines if line.startswith("| 12 x 8,192")]
    assert len(rows) == 1 and "| 20 of 8,192 |" in rows[0] and "| 1 | 1.5 |" in rows[0], rows
    assert "A note." in lines and section_lanes([], None) == []
