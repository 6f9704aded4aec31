"""The pure membership decision (``lighthouse.membership.decide``), without any network or clock."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from lighthouse import membership as m
from lighthouse.events import REASON_LIMIT, DeathCause, Died, Finished, Unattributed
from lighthouse.model import HISTORY_LIMIT

P = m.Policy(min_replicas=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, confirm_age_s=1.0)
EP = m.Endpoints()


# --- helpers --------------------------------------------------------------------------------------------------


def inc(rid: str, n: int = 1) -> str:
    return f"{rid}-inc{n}"


def apply(state: m.State, event: m.Event, policy: m.Policy = P) -> m.Outcome:
    out = m.decide(state, event, policy)
    assert out.rejection is None, out.rejection
    return out


def register(state: m.State, rid: str, now: float = 0.0, *, n: int = 1, shards: int = 1,
             policy: m.Policy = P) -> m.Outcome:
    return apply(state, m.Register(rid, inc(rid, n), shards, EP, now), policy)


def boot(ids: list[str], policy: m.Policy = P, now: float = 0.0) -> m.State:
    """Register ``ids`` at ``now`` (bootstrap waits for all of them); the first epoch must hold all of them,
    active."""
    bootstrap = dataclasses.replace(policy, expected_replicas=len(ids), join_window_s=0.0)
    state = m.State()
    for rid in ids:
        state = register(state, rid, now, policy=bootstrap).state
    assert state.epoch is not None and set(state.epoch.replica_ids()) == set(ids), state.epoch
    assert all(x.role == m.ACTIVE for x in state.epoch.members)
    return state


def seen(state: m.State, now: float, **ages: float) -> dict[str, float]:
    """last_seen: every live member heartbeated at ``now`` except those given an age."""
    return {rid: now - ages.get(rid, 0.0) for rid in state.members}


def tick(state: m.State, now: float, policy: m.Policy = P, **ages: float) -> m.Outcome:
    return apply(state, m.Tick(now, seen(state, now, **ages)), policy)


def report(state: m.State, reporter: str, suspect: str, now: float, *, epoch: int | None = None,
           policy: m.Policy = P, n: int = 1, disconnected_s: float | None = None, early: bool = False,
           **ages: float) -> m.Outcome:
    number = state.epoch.number if epoch is None and state.epoch is not None else (epoch or 0)
    return m.decide(state, m.Report(reporter, inc(reporter, n), suspect, number, "collective timed out", now,
                                    seen(state, now, **ages), disconnected_s, early), policy)


def ready(state: m.State, rid: str, role: str, now: float = 0.0, *, n: int = 1, policy: m.Policy = P) -> m.Outcome:
    return m.decide(state, m.Ready(rid, inc(rid, n), role, now), policy)


def roles(epoch: m.Epoch | None) -> dict[str, str]:
    assert epoch is not None
    return {x.replica_id: x.role for x in epoch.members}


# --- bootstrap ------------------------------------------------------------------------------------------------


def test_default_policy_forms_first_epoch_at_min_replicas() -> None:
    out = register(m.State(), "a", 1.0)
    assert out.state.epoch is not None
    assert out.state.epoch.number == 1 and roles(out.state.epoch) == {"a": m.ACTIVE}
    assert out.new_epoch(m.State()) is out.state.epoch
    assert out.state.last_number == 1 and [e.number for e in out.state.history] == [1]


def test_bootstrap_waits_for_expected_replicas() -> None:
    policy = m.Policy(min_replicas=1, expected_replicas=3, heartbeat_timeout_s=1e9, confirm_age_s=1.0)
    state = register(m.State(), "a", 0.0, policy=policy).state
    state = register(state, "b", 1.0, policy=policy).state
    assert state.epoch is None
    # No join window: time alone does not form it.
    state = apply(state, m.Tick(1000.0, {"a": 1000.0, "b": 1000.0}), policy).state
    assert state.epoch is None and state.last_number == 0
    out = register(state, "c", 1001.0, policy=policy)
    assert out.state.epoch is not None and out.state.epoch.number == 1
    assert roles(out.state.epoch) == {"a": m.ACTIVE, "b": m.ACTIVE, "c": m.ACTIVE}
    assert out.state.epoch.replica_ids() == ("a", "b", "c")  # sorted, deterministic


def test_bootstrap_join_window_after_min_replicas() -> None:
    policy = m.Policy(min_replicas=2, join_window_s=5.0, heartbeat_timeout_s=100.0, confirm_age_s=1.0)
    state = register(m.State(), "a", 0.0, policy=policy).state
    assert state.min_reached_at is None
    state = apply(state, m.Tick(50.0, {"a": 50.0}), policy).state
    assert state.epoch is None  # below min: the window has not started
    state = register(state, "b", 51.0, policy=policy).state
    assert state.min_reached_at == 51.0 and state.epoch is None
    state = register(state, "c", 53.0, policy=policy).state
    live = {"a": 55.9, "b": 55.9, "c": 55.9}
    state = apply(state, m.Tick(55.9, live), policy).state
    assert state.epoch is None
    out = apply(state, m.Tick(56.0, {k: 56.0 for k in live}), policy)
    assert out.state.epoch is not None and out.state.epoch.number == 1
    assert set(out.state.epoch.replica_ids()) == {"a", "b", "c"}
    assert out.state.epoch.reason == "bootstrap"


def test_bootstrap_window_restarts_when_registrations_drop_below_min() -> None:
    policy = m.Policy(min_replicas=2, join_window_s=5.0, heartbeat_timeout_s=100.0, confirm_age_s=1.0)
    state = register(m.State(), "a", 0.0, policy=policy).state
    state = register(state, "b", 0.0, policy=policy).state
    state = apply(state, m.Leave("b", inc("b"), "changed my mind", 1.0), policy).state
    assert state.min_reached_at is None
    state = register(state, "b", 2.0, n=2, policy=policy).state
    assert state.min_reached_at == 2.0
    state = apply(state, m.Tick(6.0, {"a": 6.0, "b": 6.0}), policy).state
    assert state.epoch is None  # the window counts from 2.0, not 0.0
    state = apply(state, m.Tick(7.0, {"a": 7.0, "b": 7.0}), policy).state
    assert state.epoch is not None and state.epoch.number == 1


def test_bootstrap_expected_replicas_with_window_forms_with_fewer() -> None:
    policy = m.Policy(min_replicas=2, expected_replicas=4, join_window_s=5.0, heartbeat_timeout_s=100.0,
                      confirm_age_s=1.0)
    state = register(m.State(), "a", 0.0, policy=policy).state
    state = register(state, "b", 0.0, policy=policy).state
    state = apply(state, m.Tick(4.9, {"a": 4.9, "b": 4.9}), policy).state
    assert state.epoch is None
    state = apply(state, m.Tick(5.0, {"a": 5.0, "b": 5.0}), policy).state
    assert state.epoch is not None and set(state.epoch.replica_ids()) == {"a", "b"}


def test_idle_tick_returns_the_same_state() -> None:
    policy = m.Policy(min_replicas=2, join_window_s=5.0, heartbeat_timeout_s=100.0, confirm_age_s=1.0)
    waiting = register(m.State(), "a", 0.0, policy=policy).state
    assert m.decide(waiting, m.Tick(1.0, {"a": 1.0}), policy).state is waiting
    state = boot(["a", "b"])
    out = tick(state, 2.0)
    assert out.state is state and out.reason == ""


# --- deaths ---------------------------------------------------------------------------------------------------


def test_missed_heartbeats_declare_death_on_tick() -> None:
    state = boot(["a", "b", "c"])
    # Not yet: 2.9 s is below the 3 s timeout.
    assert tick(state, 10.0, c=2.9).state is state
    out = tick(state, 10.0, c=3.5)
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.replica_ids() == ("a", "b")
    assert "c" not in out.state.members
    assert "replica c dead" in out.reason and "no heartbeat" in out.reason
    assert out.state.epoch.reason == out.reason


def test_member_that_never_heartbeated_dies_from_its_registration_time() -> None:
    state = boot(["a", "b"], now=0.0)
    out = apply(state, m.Tick(3.5, {"a": 3.5}))  # b never heartbeated: registered at 0.0
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("a",)


def test_burst_of_deaths_in_one_tick_forms_exactly_one_epoch() -> None:
    state = boot(["a", "b", "c", "d", "e"])
    out = tick(state, 10.0, b=4.0, c=5.0, e=3.1)
    assert out.state.epoch is not None
    assert out.state.epoch.number == state.epoch.number + 1  # type: ignore[union-attr]
    assert len(out.state.history) == len(state.history) + 1
    assert out.state.epoch.replica_ids() == ("a", "d")
    for rid in "bce":
        assert f"replica {rid} dead" in out.reason


def test_report_confirmed_when_suspect_heartbeat_is_old() -> None:
    state = boot(["a", "b", "c"])
    out = report(state, "a", "c", 10.0, c=1.5)  # older than confirm_age (1.0), younger than the timeout (3.0)
    assert out.rejection is None and out.confirmed
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.replica_ids() == ("a", "b")
    assert "confirmed" in out.reason and "blamed by a" in out.reason


def test_reports_are_not_votes_while_the_suspect_heartbeats() -> None:
    # Every other member blaming a suspect that still heartbeats does not kill it: a reporter cannot tell a
    # dead peer from one that was slower to notice the same failure. The reports are kept as suspicions.
    state = boot(["a", "b", "c", "d"])
    for i, reporter in enumerate("abc"):
        out = report(state, reporter, "d", 10.0 + 0.1 * i, d=0.2)
        assert out.rejection is None and not out.confirmed
        assert out.state.epoch is state.epoch
        state = out.state
    assert state.suspicions == {"d": frozenset({"a", "b", "c"})}
    again = report(state, "a", "d", 10.5, d=0.2)  # the same reporter twice counts once
    assert again.state.suspicions == {"d": frozenset({"a", "b", "c"})}
    dead = tick(again.state, 11.0, d=1.0)  # silence for confirm_age settles it
    assert dead.state.epoch is not None and dead.state.epoch.replica_ids() == ("a", "b", "c")
    assert dead.state.suspicions == {}  # a new epoch starts with a clean slate


def test_report_about_a_disconnected_suspect_is_confirmed_at_once() -> None:
    # Its own evidence: its connection to the lighthouse closed (its process died). No waiting for its silence,
    # whether or not the report is early.
    state = boot(["a", "b", "c"])
    for early in (False, True):
        out = report(state, "a", "c", 10.0, disconnected_s=0.01, early=early, c=0.05)
        assert out.rejection is None and out.confirmed
        assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("a", "b")
        died = [e for e in out.state.epoch.events if isinstance(e, Died)]
        assert [(d.replica_id, d.cause, d.reporters) for d in died] == [("c", DeathCause.DISCONNECTED, ("a",))]
        assert "connection closed" in out.reason and "blamed by a" in out.reason


def test_an_early_report_without_evidence_changes_nothing() -> None:
    # A live member only slower to check in: not recorded, so it never re-forms the epoch.
    state = boot(["a", "b", "c"])
    out = report(state, "a", "c", 10.0, early=True, c=0.05)
    assert out.rejection is None and not out.confirmed and out.state is state
    assert tick(out.state, 11.5, c=0.05).state is state  # no suspicion to act on later
    # Control: the same report sent when the grace ended is recorded.
    late = report(state, "a", "c", 10.0, c=0.05)
    assert late.state.suspicions == {"c": frozenset({"a"})}
    # An early report still confirms on silence, the other evidence.
    silent = report(state, "a", "c", 10.0, early=True, c=1.5)
    assert silent.confirmed and silent.state.epoch is not None and silent.state.epoch.replica_ids() == ("a", "b")


def test_unconfirmed_report_is_confirmed_by_tick_once_age_passes() -> None:
    state = boot(["a", "b", "c"])
    out = report(state, "a", "c", 10.0, c=0.2)
    assert out.rejection is None and not out.confirmed
    assert out.state.epoch is state.epoch and out.state.last_number == 1
    suspected = out.state
    # Below confirm_age: nothing happens.
    assert tick(suspected, 10.7, c=0.9).state.epoch is state.epoch
    # Control: the same age without a report is not a death (the timeout is 3 s).
    assert tick(state, 11.5, c=1.5).state is state
    confirmed = tick(suspected, 11.5, c=1.5)
    assert confirmed.state.epoch is not None and confirmed.state.epoch.number == 2
    assert confirmed.state.epoch.replica_ids() == ("a", "b")
    assert "reported by a" in confirmed.reason


def test_report_about_member_already_dead_under_the_guard_is_confirmed_without_change() -> None:
    policy = m.Policy(min_replicas=3, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b", "c"], policy)
    dead = tick(state, 10.0, policy, c=5.0).state
    assert "c" not in dead.members and dead.epoch is state.epoch  # guard: epoch unchanged
    out = report(dead, "a", "c", 10.0, policy=policy)
    assert out.confirmed and out.rejection is None and out.state is dead


def test_report_about_old_incarnation_does_not_kill_the_restarted_one() -> None:
    policy = m.Policy(min_replicas=3, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b", "c"], policy)
    restarted = register(state, "c", 5.0, n=2, policy=policy).state
    assert restarted.epoch is state.epoch  # guard held: the epoch still names c's old incarnation
    out = report(restarted, "a", "c", 10.0, policy=policy, c=5.0)
    assert out.confirmed and out.state is restarted
    assert restarted.members["c"].incarnation == inc("c", 2)


# --- join, leave, restart, reconnect --------------------------------------------------------------------------


def test_join_flow() -> None:
    state = boot(["a"])
    joined = register(state, "b", 1.0)
    assert joined.state.members["b"].role == m.JOINING and not joined.state.members["b"].in_epoch
    assert joined.state.epoch is state.epoch  # not in an epoch yet: no new one

    early = ready(joined.state, "b", m.ACTIVE, 1.5)
    assert early.rejection is not None and early.rejection.code == "FAILED_PRECONDITION"
    assert early.state is joined.state

    as_joiner = ready(joined.state, "b", m.JOINING, 2.0)
    assert as_joiner.rejection is None
    assert as_joiner.state.epoch is not None and as_joiner.state.epoch.number == 2
    assert roles(as_joiner.state.epoch) == {"a": m.ACTIVE, "b": m.JOINING}
    assert ready(as_joiner.state, "b", m.JOINING, 2.1).state is as_joiner.state  # idempotent

    active = ready(as_joiner.state, "b", m.ACTIVE, 3.0)
    assert active.rejection is None
    assert active.state.epoch is not None and active.state.epoch.number == 3
    assert roles(active.state.epoch) == {"a": m.ACTIVE, "b": m.ACTIVE}
    assert ready(active.state, "b", m.ACTIVE, 3.1).state is active.state  # idempotent
    # Only a role changed: the new epoch keeps the data-plane groups of the one the joiner entered in.
    assert as_joiner.state.epoch.data_plane == 2 and active.state.epoch.data_plane == 2


def test_data_plane_is_kept_only_when_just_roles_change() -> None:
    state = boot(["a", "b"])
    assert state.epoch is not None and state.epoch.data_plane == state.epoch.number
    joined = ready(register(state, "c", 1.0).state, "c", m.JOINING, 1.5).state
    assert joined.epoch is not None and joined.epoch.data_plane == joined.epoch.number  # a member more: new
    active = ready(joined, "c", m.ACTIVE, 2.0).state
    assert active.epoch is not None and active.epoch.data_plane == joined.epoch.number
    # A suspect still heartbeating: the re-formed epoch (same members) gets new groups (the old are broken).
    suspected = report(active, "a", "b", 2.5, epoch=active.epoch.number).state
    reformed = tick(suspected, 2.5 + P.confirm_age_s + 0.1, b=0.0).state
    assert reformed.epoch is not None and reformed.epoch.number > active.epoch.number
    assert reformed.epoch.plane_key() == active.epoch.plane_key()
    assert reformed.epoch.data_plane == reformed.epoch.number
    # A restart (same id, new incarnation) is a new member: new groups.
    restarted = register(reformed, "c", 3.0, n=2).state
    assert restarted.epoch is not None and restarted.epoch.data_plane == restarted.epoch.number


def test_restarted_replica_cannot_turn_active_on_its_old_incarnations_epoch_slot() -> None:
    policy = m.Policy(min_replicas=4, expected_replicas=4, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b", "c", "d"], policy)
    state = register(state, "b", 1.0, n=2, policy=policy).state
    state = register(state, "c", 1.0, n=2, policy=policy).state
    out = ready(state, "b", m.JOINING, 2.0, n=2, policy=policy)
    assert out.rejection is None
    state = out.state
    assert state.epoch is not None and state.epoch.number == 1  # guard: 3 of 4
    # The epoch still lists b's dead incarnation; the new one never took part in an epoch as joining. It is in
    # the data plane, so the epoch that has it is coming: refused for now, as a retry (ABORTED), not for good.
    refused = ready(state, "b", m.ACTIVE, 3.0, n=2, policy=policy)
    assert refused.rejection is not None and refused.rejection.code == "ABORTED"
    assert refused.state is state


def test_graceful_leave_forms_new_epoch() -> None:
    state = boot(["a", "b", "c"])
    out = apply(state, m.Leave("b", inc("b"), "preempted", 5.0))
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.replica_ids() == ("a", "c")
    assert "replica b left: preempted" in out.reason
    assert "b" not in out.state.members


def test_restart_declares_old_incarnation_dead_in_the_same_step() -> None:
    state = boot(["a", "b"])
    out = register(state, "b", 5.0, n=2)
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.replica_ids() == ("a",)  # old b gone; new b must fetch state first
    assert out.state.members["b"].incarnation == inc("b", 2)
    assert out.state.members["b"].role == m.JOINING
    assert "restarted" in out.reason
    # The old incarnation is fenced out.
    old = ready(out.state, "b", m.JOINING, 6.0, n=1)
    assert old.rejection is not None and old.rejection.code == "FAILED_PRECONDITION"


def test_restart_of_only_active_member_comes_back_active() -> None:
    state = boot(["a"])
    out = register(state, "a", 5.0, n=2)
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.members[0].incarnation == inc("a", 2)
    assert roles(out.state.epoch) == {"a": m.ACTIVE}


def test_reconnect_with_same_incarnation_is_idempotent() -> None:
    state = boot(["a", "b"])
    out = register(state, "b", 9.0)
    assert out.state is state and out.reason == ""


def test_everyone_dead_then_registrant_restarts_the_job_as_active() -> None:
    state = boot(["a"])
    state = register(state, "b", 1.0).state
    state = ready(state, "b", m.JOINING, 1.0).state
    assert roles(state.epoch) == {"a": m.ACTIVE, "b": m.JOINING}
    # a dies: b alone is a joiner, no one holds state to contribute: guard, epoch unchanged.
    out = tick(state, 10.0, a=5.0)
    assert out.state.epoch is state.epoch and "min-replicas guard" in out.reason
    # The job restarts from a checkpoint: a new registrant is active.
    back = register(out.state, "c", 11.0)
    assert back.state.members["c"].role == m.ACTIVE
    assert back.state.epoch is not None and back.state.epoch.number == 3
    assert roles(back.state.epoch) == {"b": m.JOINING, "c": m.ACTIVE}


# --- the split-brain guard -------------------------------------------------------------------------------------


def test_min_replicas_guard_keeps_epoch_until_a_joiner_brings_it_back() -> None:
    policy = m.Policy(min_replicas=2, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b", "c"], policy)
    out = tick(state, 10.0, policy, b=4.0, c=4.0)
    assert out.state.epoch is state.epoch and out.state.last_number == 1
    assert "min-replicas guard" in out.reason
    assert set(out.state.members) == {"a"}
    state = out.state
    state = register(state, "d", 11.0, policy=policy).state
    assert state.epoch is not None and state.epoch.number == 1
    back = ready(state, "d", m.JOINING, 12.0, policy=policy)
    assert back.state.epoch is not None and back.state.epoch.number == 2
    assert roles(back.state.epoch) == {"a": m.ACTIVE, "d": m.JOINING}


def test_leave_below_min_replicas_leaves_epoch_unchanged() -> None:
    policy = m.Policy(min_replicas=2, expected_replicas=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b"], policy)
    out = apply(state, m.Leave("b", inc("b"), "", 1.0), policy)
    assert out.state.epoch is state.epoch and "min-replicas guard" in out.reason


# --- refusals ---------------------------------------------------------------------------------------------------


def _three() -> m.State:
    state = boot(["a", "b", "c"])
    state = tick(state, 10.0, c=5.0).state  # epoch 2: a, b
    state = register(state, "j", 11.0).state  # a joiner, not in the epoch
    assert state.epoch is not None and state.epoch.number == 2
    return state


REFUSALS: list[tuple[str, Any, str]] = [
    ("shard count mismatch", m.Register("z", "z-1", 8, EP, 12.0), "INVALID_ARGUMENT"),
    ("stale epoch report", m.Report("a", inc("a"), "b", 1, "", 12.0, {}), "FAILED_PRECONDITION"),
    ("future epoch report", m.Report("a", inc("a"), "b", 3, "", 12.0, {}), "INVALID_ARGUMENT"),
    ("reporter is suspect", m.Report("a", inc("a"), "a", 2, "", 12.0, {}), "INVALID_ARGUMENT"),
    ("unregistered reporter", m.Report("x", "x-1", "a", 2, "", 12.0, {}), "NOT_FOUND"),
    ("reporter's old incarnation", m.Report("a", "a-old", "b", 2, "", 12.0, {}), "FAILED_PRECONDITION"),
    ("reporter not in the epoch", m.Report("j", inc("j"), "a", 2, "", 12.0, {}), "FAILED_PRECONDITION"),
    ("suspect not in the epoch", m.Report("a", inc("a"), "j", 2, "", 12.0, {}), "NOT_FOUND"),
    ("ready unknown replica", m.Ready("x", "x-1", m.JOINING, 12.0), "NOT_FOUND"),
    ("ready wrong incarnation", m.Ready("j", "j-old", m.JOINING, 12.0), "FAILED_PRECONDITION"),
    ("ready bad role", m.Ready("j", inc("j"), "leader", 12.0), "INVALID_ARGUMENT"),
    ("ready active before joining", m.Ready("j", inc("j"), m.ACTIVE, 12.0), "FAILED_PRECONDITION"),
    ("leave unknown replica", m.Leave("x", "x-1", "", 12.0), "NOT_FOUND"),
    ("leave wrong incarnation", m.Leave("a", "a-old", "", 12.0), "FAILED_PRECONDITION"),
    # An incarnation that died is over for good: refused as such, not as unknown ("register again").
    ("leave of a dead replica", m.Leave("c", inc("c"), "", 12.0), "FAILED_PRECONDITION"),
    ("ready of a dead replica", m.Ready("c", inc("c"), m.JOINING, 12.0), "FAILED_PRECONDITION"),
    ("register of a dead incarnation", m.Register("c", inc("c"), 1, EP, 12.0), "FAILED_PRECONDITION"),
    ("register with a bogus claim", m.Register("z", "z-1", 1, EP, 12.0, claim="leader"), "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize("name,event,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_return_the_identical_state(name: str, event: Any, code: str) -> None:
    state = _three()
    out = m.decide(state, event, P)
    assert out.rejection is not None, name
    assert out.rejection.code == code and out.rejection.message
    assert out.state is state and not out.confirmed and out.new_epoch(state) is None


def test_report_before_any_epoch_is_refused() -> None:
    policy = m.Policy(min_replicas=1, expected_replicas=3, heartbeat_timeout_s=3.0, confirm_age_s=1.0)
    state = register(m.State(), "a", 0.0, policy=policy).state
    state = register(state, "b", 0.0, policy=policy).state
    out = m.decide(state, m.Report("a", inc("a"), "b", 0, "", 1.0, {}), policy)
    assert out.rejection is not None and out.rejection.code == "FAILED_PRECONDITION"
    assert out.state is state


def test_unknown_event_type_raises() -> None:
    with pytest.raises(TypeError):
        m.decide(m.State(), object(), P)  # type: ignore[arg-type]


def test_policy_validation() -> None:
    for bad in (dict(min_replicas=0), dict(heartbeat_interval_s=3.0, heartbeat_timeout_s=3.0),
                dict(confirm_age_s=0.0), dict(confirm_age_s=5.0, heartbeat_timeout_s=3.0),
                dict(join_window_s=-1.0), dict(expected_replicas=-1)):
        with pytest.raises(ValueError):
            m.Policy(**bad)  # type: ignore[arg-type]


def test_mass_death_reason_is_clipped() -> None:
    ids = [f"r{i:03d}" for i in range(300)]
    state = boot(ids)
    out = tick(state, 10.0, **{rid: 5.0 for rid in ids[1:]})
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("r000",)
    assert len(out.state.epoch.reason) <= REASON_LIMIT + 40
    assert "more)" in out.state.epoch.reason


def test_history_is_bounded_and_numbers_keep_going() -> None:
    state = boot(["a"])
    now = 1.0
    for i in range(HISTORY_LIMIT + 10):
        now += 1.0
        state = register(state, "a", now, n=i + 2).state  # each restart forms an epoch
    assert state.last_number == HISTORY_LIMIT + 11
    assert len(state.history) == HISTORY_LIMIT
    assert state.history[-1] is state.epoch
    numbers = [e.number for e in state.history]
    assert numbers == list(range(state.last_number - HISTORY_LIMIT + 1, state.last_number + 1))


# --- property: random event sequences ---------------------------------------------------------------------------

POLICIES = [
    m.Policy(min_replicas=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, confirm_age_s=1.0),
    m.Policy(min_replicas=2, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
             confirm_age_s=1.0),
    m.Policy(min_replicas=3, join_window_s=2.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0,
             confirm_age_s=0.5),
]


def _random_event(rng: random.Random, state: m.State, now: float, last_seen: dict[str, float],
                  incs: dict[str, int]) -> m.Event:
    ids = [f"r{i}" for i in range(7)]
    rid = rng.choice(ids)
    # Mostly the replica's current incarnation, sometimes a stale or future one.
    n = incs.get(rid, 1) + rng.choice([0, 0, 0, 0, 0, -1, 1])
    k = rng.random()
    if k < 0.25:
        # A restart; a process whose incarnation is over always restarts (it cannot register that one again).
        if rng.random() < 0.2 or state.is_departed(rid, inc(rid, incs.get(rid, 1))):
            incs[rid] = incs.get(rid, 1) + 1
            n = incs[rid]
        return m.Register(rid, inc(rid, n), rng.choice([1, 1, 1, 1, 1, 1, 2]), EP, now)
    if k < 0.45:
        return m.Ready(rid, inc(rid, n), rng.choice([m.JOINING, m.JOINING, m.ACTIVE, m.ACTIVE, "bogus"]), now)
    if k < 0.52:
        return m.Leave(rid, inc(rid, n), "random leave", now)
    if k < 0.7:
        current = state.epoch.number if state.epoch is not None else 0
        return m.Report(rid, inc(rid, n), rng.choice(ids), max(0, current + rng.choice([0, 0, 0, -1, 1])),
                        "random report", now, dict(last_seen))
    return m.Tick(now, dict(last_seen))


@pytest.mark.parametrize("seed", range(6))
def test_random_event_sequences_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    policy = POLICIES[seed % len(POLICIES)]
    state = m.State()
    now = 0.0
    last_seen: dict[str, float] = {}
    incs: dict[str, int] = {}
    numbers_issued: list[int] = []
    over: set[tuple[str, str]] = set()
    epochs_formed = refusals = 0
    for _ in range(400):
        now += rng.choice([0.0, 0.05, 0.2, 0.5, 1.0, 2.5])
        # Most live members heartbeat; some go quiet.
        for rid in state.members:
            if rng.random() < 0.8:
                last_seen[rid] = now
        event = _random_event(rng, state, now, last_seen, incs)
        before = state
        out = m.decide(before, event, policy)
        if out.rejection is not None:
            refusals += 1
            assert out.state is before, event
            assert out.rejection.code in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED")
            continue
        state = out.state
        for rid in set(last_seen) - set(state.members):
            del last_seen[rid]
        over |= {(rid, i) for rid, gone in state.departed.items() for i in gone}
        assert not over & {(x.replica_id, x.incarnation) for x in state.members.values()}, \
            "an incarnation that died, left or was replaced never comes back"
        assert state.last_number >= before.last_number
        new = out.new_epoch(before)
        if new is not None:
            epochs_formed += 1
            assert new.number == before.last_number + 1, "numbers go up by one"
            assert new.number not in numbers_issued, "numbers are never reused"
            numbers_issued.append(new.number)
            assert state.history[-1] is new
            assert len(new.members) >= policy.min_replicas, "split-brain guard"
            assert any(x.role == m.ACTIVE for x in new.members), "an epoch has an active member"
            ids = new.replica_ids()
            assert list(ids) == sorted(set(ids)), "members unique and sorted"
            for x in new.members:
                live = state.members[x.replica_id]
                assert live.incarnation == x.incarnation and live.in_epoch and live.role == x.role
            if before.epoch is not None and new.key() == before.epoch.key():
                # Only a suspect that kept heartbeating re-forms an epoch with the same members.
                assert new.reason.startswith("re-formed"), new.reason
        else:
            assert state.epoch is before.epoch
        if state.epoch is not None:
            assert state.epoch.number == state.last_number
        history = [e.number for e in state.history]
        assert history == sorted(set(history)), "history numbers strictly increase"
        assert len(history) <= HISTORY_LIMIT
        # All live members share one shard count.
        assert len({x.shard_count for x in state.members.values()}) <= 1
    # The run exercised the machine rather than refusing everything.
    assert epochs_formed >= 3, epochs_formed
    assert refusals >= 20, refusals
    assert numbers_issued == list(range(1, len(numbers_issued) + 1))


def test_guard_blocked_job_can_take_several_joiners_to_recover() -> None:
    # min_replicas=3 and only one survivor: one joiner alone cannot lift the guard (2 < 3), so it never gets an
    # epoch to sync in. A second joiner must still be let in, or the job is stuck forever.
    policy = m.Policy(min_replicas=3, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0)
    state = boot(["a", "b", "c"], policy)
    state = tick(state, 10.0, policy, b=5.0, c=5.0).state
    assert state.epoch is not None and state.epoch.number == 1 and set(state.members) == {"a"}
    for rid in ("d", "e"):
        state = register(state, rid, 11.0, policy=policy).state
    first = ready(state, "d", m.JOINING, 12.0, policy=policy)
    assert first.rejection is None and first.state.epoch.number == 1  # type: ignore[union-attr]
    second = ready(first.state, "e", m.JOINING, 12.5, policy=policy)
    assert second.rejection is None, second.rejection
    assert second.state.epoch is not None and second.state.epoch.number == 2
    assert roles(second.state.epoch) == {"a": m.ACTIVE, "d": m.JOINING, "e": m.JOINING}


def test_one_joiner_syncs_at_a_time() -> None:
    state = boot(["a", "b"])
    for rid in ("c", "d"):
        state = register(state, rid, 1.0).state
    state = ready(state, "c", m.JOINING, 2.0).state
    assert state.epoch is not None and state.epoch.number == 2  # c syncs in epoch 2
    busy = ready(state, "d", m.JOINING, 2.5)
    assert busy.rejection is not None and busy.rejection.code == "ABORTED" and busy.state is state
    state = ready(state, "c", m.ACTIVE, 3.0).state
    assert state.epoch is not None and state.epoch.number == 3
    after = ready(state, "d", m.JOINING, 3.5)
    assert after.rejection is None and after.state.epoch.number == 4  # type: ignore[union-attr]


def test_reported_suspect_that_keeps_heartbeating_re_forms_the_epoch_once() -> None:
    state = boot(["a", "b", "c"])
    pending = report(state, "a", "c", 10.0, c=0.1)
    assert not pending.confirmed and pending.state.epoch is state.epoch
    early = tick(pending.state, 10.9, c=0.1)
    assert early.state.epoch is state.epoch  # not yet confirm_age (1 s) since the report
    out = tick(pending.state, 11.0, c=0.1)  # c heartbeated throughout: alive, but the reporters' plane broke
    assert out.state.epoch is not None and out.state.epoch.number == 2
    assert out.state.epoch.key() == state.epoch.key()  # type: ignore[union-attr]
    assert out.state.epoch.reason.startswith("re-formed") and "c" in out.state.epoch.reason
    assert out.state.suspicions == {} and out.state.suspected_at == {}
    assert tick(out.state, 12.5).state is out.state  # once, not on every tick


def test_live_suspect_re_forms_the_epoch_then_is_declared_hung() -> None:
    # A suspect whose heartbeat thread lives on while its training is stuck: each report re-forms the epoch
    # (same members, new number) so the reporters rebuild; after max_reforms of them it is declared dead.
    policy = dataclasses.replace(P, max_reforms=2)
    state = boot(["a", "b", "c"], policy)
    numbers = []
    for round_ in range(2):
        t = 10.0 + 10 * round_
        state = report(state, "a", "c", t, policy=policy, c=0.1).state
        assert tick(state, t + 0.5, policy, c=0.1).state.epoch is state.epoch  # not yet: confirm_age is 1 s
        out = tick(state, t + 1.0, policy, c=0.1)
        assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("a", "b", "c")
        assert "re-formed" in out.reason
        numbers.append(out.state.epoch.number)
        state = out.state
    assert numbers == sorted(set(numbers)) and state.reforms == {"c": 2}
    state = report(state, "b", "c", 30.0, policy=policy, c=0.1).state
    hung = tick(state, 31.0, policy, c=0.1)
    assert hung.state.epoch is not None and hung.state.epoch.replica_ids() == ("a", "b")
    assert "hung" in hung.reason and hung.state.reforms == {}


def test_reforms_count_only_consecutive_epochs() -> None:
    policy = dataclasses.replace(P, max_reforms=1)
    state = boot(["a", "b", "c", "d"], policy)
    state = report(state, "a", "c", 10.0, policy=policy, c=0.1).state
    state = tick(state, 11.0, policy, c=0.1).state
    assert state.reforms == {"c": 1}
    # Another reason for a new epoch (a death) clears the count: c is not hung for an unrelated later report.
    state = tick(state, 20.0, policy, d=5.0).state
    assert state.epoch is not None and "d" not in state.epoch.replica_ids() and state.reforms == {}
    state = report(state, "a", "c", 21.0, policy=policy, c=0.1).state
    out = tick(state, 22.0, policy, c=0.1)
    assert "re-formed" in out.reason and out.state.epoch is not None and "c" in out.state.epoch.replica_ids()


def test_a_suspect_that_trained_between_reports_starts_its_reforms_over() -> None:
    """Found by the simulator (seeds 6017, 9358, 16820, docs/chaos.md): re-forms used to add up across unrelated
    incidents tens of seconds apart (a false blame over a slow link, then another, then a peer's partition) and
    a healthy replica was declared hung. A suspect whose heartbeats' step moved on since its last report trained
    in between: not hung. One whose step stands still (stuck training) is still declared hung."""
    policy = dataclasses.replace(P, max_reforms=2)

    def rounds(steps: list[int]) -> m.State:
        state = boot(["a", "b", "c"], policy)
        for i, step in enumerate(steps):
            t = 10.0 + 10 * i
            out = m.decide(state, m.Report("a", inc("a"), "c", state.epoch.number, "collective timed out", t,  # type: ignore[union-attr]
                                           seen(state, t, c=0.1), suspect_step=step), policy)
            assert out.rejection is None
            state = tick(out.state, t + 1.0, policy, c=0.1).state
        return state

    training = rounds([100, 150, 200, 250])
    assert training.epoch is not None and "c" in training.epoch.replica_ids()
    assert training.reforms == {"c": 1} and training.report_steps == {"c": 250}
    stuck = rounds([100, 100, 100])
    assert stuck.epoch is not None and "c" not in stuck.epoch.replica_ids()  # hung: dead
    unknown = rounds([100, 150])  # the count starts over on progress only, never on a missing step
    assert unknown.reforms == {"c": 1}


def test_no_hung_verdict_while_the_guard_holds_and_a_dead_reporters_blame_goes_with_it() -> None:
    """Found by the simulator (seed 220115, docs/chaos.md): with the min-replicas guard holding the epoch, every
    liveness tick (50 ms) counted as a re-form, so a live suspect was declared hung 0.15 s after a false report;
    and the report came from a replica that had died since. No epoch re-formed, nothing counts; a dead reporter's
    reports go with it."""
    policy = dataclasses.replace(P, max_reforms=2, min_replicas=2)
    state = boot(["a", "b", "c"], policy)
    state = tick(state, 5.0, policy, c=4.0).state  # c dead; epoch {a, b}
    assert state.epoch is not None and state.epoch.replica_ids() == ("a", "b")
    state = report(state, "a", "b", 6.0, policy=policy, b=0.1).state  # a false blame of b...
    assert state.suspicions == {"b": frozenset({"a"})}
    # ...then a dies (killed: its connection closed), and the guard holds the epoch with one member left.
    out = report(state, "b", "a", 6.2, policy=policy, disconnected_s=0.05)
    state = out.state
    assert "a" not in state.members and state.suspicions == {} and state.suspected_at == {}
    for i in range(10):  # the ticks that counted re-forms before
        state = tick(state, 7.5 + 0.05 * i, policy).state
    assert "b" in state.members and state.reforms == {}
    # With a live reporter and the guard holding (c and d dead, min 3), ticks count nothing either.
    policy3 = dataclasses.replace(P, max_reforms=2, min_replicas=3)
    state = boot(["a", "b", "c", "d"], policy3)
    state = tick(state, 5.0, policy3, d=4.0).state
    state = tick(state, 6.0, policy3, c=4.0).state  # guard: 2 of 3 required
    state = report(state, "a", "b", 7.0, policy=policy3, b=0.1).state
    for i in range(10):
        state = tick(state, 8.0 + 0.05 * i, policy3).state
    assert "b" in state.members and state.reforms == {} and state.suspicions == {"b": frozenset({"a"})}


def test_max_reforms_zero_never_declares_a_live_suspect_dead() -> None:
    policy = dataclasses.replace(P, max_reforms=0)
    state = boot(["a", "b"], policy)
    for round_ in range(4):
        t = 10.0 + 10 * round_
        state = report(state, "a", "b", t, policy=policy, b=0.1).state
        state = tick(state, t + 1.0, policy, b=0.1).state
        assert state.epoch is not None and state.epoch.replica_ids() == ("a", "b")


# --- a joiner that never turns active -----------------------------------------------------------------------------


def test_a_stuck_joiner_is_dropped_at_its_deadline_and_does_not_block_the_next() -> None:
    policy = dataclasses.replace(P, join_deadline_s=60.0)
    state = boot(["a", "b"], policy)
    for rid in ("c", "d"):
        state = register(state, rid, 1.0, policy=policy).state
    state = ready(state, "c", m.JOINING, 2.0, policy=policy).state  # c syncs in epoch 2, then its Ready(ACTIVE)
    assert state.epoch is not None and state.epoch.number == 2 and state.members["c"].syncing_since == 2.0
    busy = ready(state, "d", m.JOINING, 30.0, policy=policy)  # never arrives
    assert busy.rejection is not None and busy.rejection.code == "ABORTED"
    assert tick(state, 61.9, policy).state.epoch is state.epoch  # not before the deadline
    out = tick(state, 62.1, policy)
    assert "c" not in out.state.members and out.state.epoch is not None and out.state.epoch.number == 3
    died = [e for e in out.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause) for e in died] == [("c", DeathCause.STALLED)] and died[0].joining_s > 60
    assert "c dropped (joining for 60s in the data plane without turning active)" in out.reason
    assert out.state.is_departed("c", inc("c"))  # its heartbeats are told so: it restarts as a new incarnation
    nxt = ready(out.state, "d", m.JOINING, 63.0, policy=policy)
    assert nxt.rejection is None and roles(nxt.state.epoch)["d"] == m.JOINING


def test_the_join_deadline_counts_from_the_epoch_that_put_the_joiner_in_the_data_plane() -> None:
    # A joiner held out of any epoch by the min-replicas guard is not syncing: its clock starts when one forms.
    policy = m.Policy(min_replicas=3, expected_replicas=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                      confirm_age_s=1.0, join_deadline_s=60.0)
    state = boot(["a", "b", "c"], policy)
    state = tick(state, 10.0, policy, b=5.0, c=5.0).state
    for rid in ("d", "e"):
        state = register(state, rid, 11.0, policy=policy).state
    state = ready(state, "d", m.JOINING, 12.0, policy=policy).state
    assert state.members["d"].syncing_since is None  # the guard holds: no epoch has it
    assert tick(state, 100.0, policy).state.members.get("d") is not None
    state = ready(state, "e", m.JOINING, 100.0, policy=policy).state
    assert state.epoch is not None and state.epoch.number == 2
    assert state.members["d"].syncing_since == state.members["e"].syncing_since == 100.0
    assert set(tick(state, 150.0, policy).state.members) == {"a", "d", "e"}


def test_join_deadline_zero_never_drops_a_joiner() -> None:
    policy = dataclasses.replace(P, join_deadline_s=0.0)
    state = ready(register(boot(["a"], policy), "b", 1.0, policy=policy).state, "b", m.JOINING, 2.0,
                  policy=policy).state
    assert "b" in tick(state, 1e6, policy).state.members


# --- a lighthouse that lost its state relearns it ------------------------------------------------------------------


def reclaim(state: m.State, rid: str, claim: str, last_epoch: int, now: float, policy: m.Policy = P) -> m.Outcome:
    return apply(state, m.Register(rid, inc(rid), 1, EP, now, claim=claim, last_epoch=last_epoch), policy)


def test_a_reclaimed_joiner_that_caught_up_before_the_first_epoch_is_told_to_retry_not_refused() -> None:
    """Found by the simulator (seed 2490, docs/chaos.md): a joiner syncing when the lighthouse lost its state
    takes its data-plane role back and asks to turn active before the new lighthouse's first epoch forms. That
    is a retry (ABORTED), not a refusal for good (FAILED_PRECONDITION: its client stopped asking and it stayed
    joining until the join deadline, holding the one joiner slot)."""
    state = reclaim(m.State(), "a", m.ACTIVE, 7, 100.0).state
    state = reclaim(state, "c", m.JOINING, 7, 100.1).state
    early = m.decide(state, m.Ready("c", inc("c"), m.ACTIVE, 100.5), P)
    assert early.rejection is not None and early.rejection.code == "ABORTED", early.rejection
    assert early.state is state
    state = tick(state, 103.2).state
    assert state.epoch is not None and roles(state.epoch) == {"a": m.ACTIVE, "c": m.JOINING}
    assert roles(apply(state, m.Ready("c", inc("c"), m.ACTIVE, 103.5)).state.epoch) == {"a": m.ACTIVE,  # type: ignore[arg-type]
                                                                                           "c": m.ACTIVE}
    # One that never asked to enter the data plane is still refused for good.
    plain = register(boot(["a"]), "d", 1.0).state
    refused = m.decide(plain, m.Ready("d", inc("d"), m.ACTIVE, 2.0), P)
    assert refused.rejection is not None and refused.rejection.code == "FAILED_PRECONDITION"


def test_returning_members_get_their_roles_back_and_numbers_go_on() -> None:
    # A fresh lighthouse (in-memory store, restarted): a, b were active and c syncing as a joiner in epoch 7.
    out = reclaim(m.State(), "a", m.ACTIVE, 7, 100.0)
    state = out.state
    assert state.epoch is None and state.last_number == 7 and state.members["a"].role == m.ACTIVE
    assert "registered again as active (this lighthouse had lost it)" in out.reason
    # It waits a heartbeat timeout for the others (each is told it is unknown at its next heartbeat).
    state = reclaim(state, "b", m.ACTIVE, 6, 101.0).state
    state = reclaim(state, "c", m.JOINING, 7, 101.5).state
    assert tick(state, 102.9).state.epoch is None
    epoch = tick(state, 103.1).state.epoch
    assert epoch is not None and epoch.number == 8  # above every number the members saw
    assert roles(epoch) == {"a": m.ACTIVE, "b": m.ACTIVE, "c": m.JOINING}
    assert [(x.replica_id, x.incarnation) for x in epoch.members] == [(r, inc(r)) for r in ("a", "b", "c")]


def test_returning_members_form_at_once_with_the_expected_count() -> None:
    policy = dataclasses.replace(P, expected_replicas=2)
    state = reclaim(m.State(), "a", m.ACTIVE, 3, 0.0, policy).state
    epoch = reclaim(state, "b", m.ACTIVE, 3, 0.1, policy).state.epoch
    assert epoch is not None and epoch.number == 4 and roles(epoch) == {"a": m.ACTIVE, "b": m.ACTIVE}


def test_a_newcomer_made_active_before_the_members_came_back_must_catch_up_from_them() -> None:
    policy = dataclasses.replace(P, expected_replicas=3)
    state = register(m.State(), "new", 0.0, policy=policy).state
    assert state.members["new"].role == m.ACTIVE  # a fresh lighthouse cannot know the job trained before
    state = reclaim(state, "a", m.ACTIVE, 5, 0.5, policy).state
    assert state.members["new"].role == m.JOINING and not state.members["new"].in_epoch
    # From now on the lighthouse knows the job trained: a newcomer joins.
    state = register(state, "n2", 0.6, policy=policy).state
    assert state.members["n2"].role == m.JOINING
    epoch = tick(state, 0.5 + P.heartbeat_timeout_s + 0.1, policy).state.epoch
    assert epoch is not None and epoch.number == 6 and roles(epoch) == {"a": m.ACTIVE}


def test_a_claim_is_plain_registration_once_an_epoch_formed_or_without_an_epoch_seen() -> None:
    state = reclaim(m.State(), "a", m.ACTIVE, 4, 0.0).state
    state = tick(state, 3.1).state
    assert state.epoch is not None and state.epoch.number == 5
    # b comes back too late: the others went on without it, its state may be behind. It gets the plain role
    # (joining), and its client gives up that incarnation.
    late = reclaim(state, "b", m.ACTIVE, 4, 4.0).state
    assert late.members["b"].role == m.JOINING and not late.members["b"].in_epoch and late.epoch is state.epoch
    # A claim without an epoch seen is a bootstrap registration (nobody trained).
    fresh = reclaim(m.State(), "a", m.JOINING, 0, 0.0).state
    assert fresh.members["a"].role == m.ACTIVE and not fresh.members["a"].reclaimed and fresh.last_number == 1


# --- bounded escalation --------------------------------------------------------------------------------------------


def blame_round(state: m.State, blame: dict[str, list[str]], t: float, policy: m.Policy) -> m.Outcome:
    """Every reporter blames its suspects in the current epoch at ``t``; everyone keeps heartbeating."""
    for reporter, suspects in blame.items():
        for suspect in suspects:
            out = report(state, reporter, suspect, t, policy=policy)
            assert out.rejection is None, out.rejection
            state = out.state
    return tick(state, t + policy.confirm_age_s, policy)


def test_symmetric_mutual_blame_evicts_at_most_one_replica_and_says_why() -> None:
    # A fault nobody can attribute (each of a, b, c blames the other two) for many re-forms in a row.
    policy = dataclasses.replace(P, max_reforms=2, min_replicas=2)
    state = boot(["a", "b", "c"], policy)
    everyone = {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}
    evicted: list[str] = []
    for round_ in range(12):
        live = state.epoch.replica_ids()  # type: ignore[union-attr]
        out = blame_round(state, {r: [s for s in everyone[r] if s in live] for r in live}, 10.0 + 10 * round_,
                          policy)
        state = out.state
        assert state.epoch is not None and len(state.epoch.members) >= policy.min_replicas
        dead = [e.replica_id for e in out.events if isinstance(e, Died)]
        assert len(dead) <= 1, out.reason
        if dead:
            note = [e for e in out.events if isinstance(e, Unattributed)]
            assert note and note[0].evicted == tuple(dead) and len(note[0].suspects) == 3
            assert "blame not attributable among a, b, c" in out.reason and f"only {dead[0]} evicted" in out.reason
        evicted += dead
    # One replica went (of the tied ones, the newest registration, then the highest id: c), then the guard kept
    # the other two.
    assert evicted == ["c"] and state.epoch.replica_ids() == ("a", "b")  # type: ignore[union-attr]
    assert "none evicted (it would break the min-replicas guard)" in state.epoch.reason  # type: ignore[union-attr]


def test_symmetric_mutual_blame_at_min_replicas_evicts_no_one() -> None:
    policy = dataclasses.replace(P, max_reforms=1, min_replicas=3)
    state = boot(["a", "b", "c"], policy)
    for round_ in range(6):
        out = blame_round(state, {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}, 10.0 + 10 * round_, policy)
        state = out.state
        assert set(state.members) == {"a", "b", "c"} and not [e for e in out.events if isinstance(e, Died)]
        assert state.epoch is not None and state.epoch.replica_ids() == ("a", "b", "c")


def test_a_replica_blamed_by_all_others_is_still_evicted() -> None:
    policy = dataclasses.replace(P, max_reforms=2)
    state = boot(["a", "b", "c"], policy)
    for round_ in range(2):
        out = blame_round(state, {"a": ["c"], "b": ["c"]}, 10.0 + 10 * round_, policy)
        assert "re-formed" in out.reason
        state = out.state
    out = blame_round(state, {"a": ["c"], "b": ["c"]}, 30.0, policy)
    died = [e for e in out.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause, e.reporters) for e in died] == [("c", DeathCause.HUNG, ("a", "b"))]
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("a", "b")
    assert "blamed by a,b" in out.reason and "not attributable" not in out.reason


def test_a_replica_whose_network_broke_is_evicted_alone() -> None:
    # a cannot reach anyone: it blames b and c, and they both blame a (each only a).
    policy = dataclasses.replace(P, max_reforms=1)
    state = boot(["a", "b", "c"], policy)
    blame = {"a": ["b", "c"], "b": ["a"], "c": ["a"]}
    state = blame_round(state, blame, 10.0, policy).state
    out = blame_round(state, blame, 20.0, policy)
    assert [e.replica_id for e in out.events if isinstance(e, Died)] == ["a"]
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("b", "c")


def test_two_hung_replicas_blamed_by_every_unblamed_member_both_go() -> None:
    policy = dataclasses.replace(P, max_reforms=1)
    state = boot(["a", "b", "c", "d"], policy)
    blame = {"a": ["c", "d"], "b": ["c", "d"]}
    state = blame_round(state, blame, 10.0, policy).state
    out = blame_round(state, blame, 20.0, policy)
    assert sorted(e.replica_id for e in out.events if isinstance(e, Died)) == ["c", "d"]
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("a", "b")


def test_one_member_blaming_everyone_is_itself_evicted_never_the_others() -> None:
    """Issue 41: with 5 replicas and ``min_replicas`` 2, one member's reports blaming all the others (nobody
    blaming it, no step advancing) got the four declared hung, leaving the blamer alone. Now the lone blamer is
    the suspect, and nobody is ever left with fewer than ``min_replicas`` members."""
    policy = dataclasses.replace(P, max_reforms=2, min_replicas=2)
    state = boot(["a", "b", "c", "d", "e"], policy)
    died: list[Died] = []
    for round_ in range(8):
        live = state.epoch.replica_ids()  # type: ignore[union-attr]
        if "a" not in live:
            break
        out = blame_round(state, {"a": [x for x in live if x != "a"]}, 10.0 + 10 * round_, policy)
        state = out.state
        assert state.epoch is not None and len(state.epoch.members) >= policy.min_replicas
        died += [e for e in out.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause, e.blamed) for e in died] == [("a", DeathCause.BLAMER, ("b", "c", "d", "e"))]
    assert state.epoch is not None and state.epoch.replica_ids() == ("b", "c", "d", "e")
    assert "replica a evicted (alone, it blamed every other member (b,c,d,e)" in state.epoch.reason


def test_a_lone_blamer_is_evicted_even_while_the_members_it_blames_train_on() -> None:
    """Issue 41, found by the simulator (seed 4 with the blame-all fault, docs/chaos.md): the members a lone blamer
    blamed trained between its reports, so their re-forms kept starting over and nobody was ever convicted; its
    reports then tipped a later, real fault's verdict onto one of them. It is the suspect after ``max_reforms``
    consecutive re-forms of its own, and the others never pay; ``min_replicas`` still binds."""
    policy = dataclasses.replace(P, max_reforms=2, min_replicas=2)
    state = boot(["a", "b", "c", "d"], policy)
    died: list[Died] = []
    for round_ in range(6):
        live = state.epoch.replica_ids()  # type: ignore[union-attr]
        if "a" not in live:
            break
        t = 10.0 + 10 * round_
        for suspect in (x for x in live if x != "a"):  # the blamed train on: their step moves between reports
            out = m.decide(state, m.Report("a", inc("a"), suspect, state.epoch.number,  # type: ignore[union-attr]
                                           "collective timed out", t, seen(state, t), suspect_step=100 * round_),
                           policy)
            assert out.rejection is None
            state = out.state
        out = tick(state, t + policy.confirm_age_s, policy)
        state = out.state
        died += [e for e in out.events if isinstance(e, Died)]
        if not died:
            assert state.reforms == {} or max(state.reforms.values()) < policy.max_reforms  # nobody else counts up
    assert [(e.replica_id, e.cause) for e in died] == [("a", DeathCause.BLAMER)], [str(e) for e in died]
    assert state.epoch is not None and state.epoch.replica_ids() == ("b", "c", "d") and state.lone_blames == {}
    guarded = dataclasses.replace(policy, min_replicas=4)  # evicting it would leave 3: kept, and said so
    state = boot(["a", "b", "c", "d"], guarded)
    for round_ in range(5):
        out = blame_round(state, {"a": ["b", "c", "d"]}, 10.0 + 10 * round_, guarded)
        state = out.state
        assert not [e for e in out.events if isinstance(e, Died)]
    assert "none evicted (it would break the min-replicas guard)" in state.epoch.reason  # type: ignore[union-attr]


def test_a_lone_blamers_word_never_confirms_a_death_beside_a_dropped_connection() -> None:
    """Found by the simulator (seed 102016 with the blame-all fault): a blamed member's connection blipped while a
    lone blamer's report of it arrived, and the dropped connection confirmed its death. A lone blamer's word alone
    records a suspicion only; beside another reporter's, the dropped connection confirms as before."""
    state = boot(["a", "b", "c"])
    state = report(state, "a", "c", 10.0).state
    out = report(state, "a", "b", 10.1, disconnected_s=0.2)  # a blames everyone; b's connection just dropped
    assert out.rejection is None and not out.confirmed and "b" in out.state.members
    after = tick(out.state, 10.2, P).state  # nor does the liveness tick take the dropped connection as proof
    assert "b" in after.members
    out = report(out.state, "c", "b", 10.3, disconnected_s=0.4)  # a second reporter: credible
    assert out.confirmed and "b" not in out.state.members


def test_with_two_members_left_the_one_that_blamed_everyone_all_along_is_the_suspect() -> None:
    """Found by the simulator (seed 102999 with the blame-all fault): a lone blamer of three lost one member to a
    real fault, then went on blaming the one left, who blamed nobody; with two members the evidence was
    symmetric and the blamed one was evicted. A member that blamed everyone before is the suspect with two too."""
    policy = dataclasses.replace(P, max_reforms=1)
    state = boot(["a", "b", "c"], policy)
    state = blame_round(state, {"a": ["b", "c"]}, 10.0, policy).state  # one re-form as a lone blamer
    assert state.lone_blames == {"a": 1}
    state = tick(state, 12.0, policy, c=5.0).state  # c dies (silent): a new epoch of a and b, the count kept
    assert state.epoch is not None and state.epoch.replica_ids() == ("a", "b") and state.lone_blames == {"a": 1}
    died: list[Died] = []
    for round_ in range(4):
        if "a" not in state.epoch.replica_ids():  # type: ignore[union-attr]
            break
        out = blame_round(state, {"a": ["b"]}, 20.0 + 10 * round_, policy)
        state = out.state
        died += [e for e in out.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause) for e in died] == [("a", DeathCause.BLAMER)]
    fresh = boot(["a", "b"], policy)  # no history: with two members the blamed one goes, as before
    for round_ in range(3):
        if "b" not in fresh.members:
            break
        fresh = blame_round(fresh, {"a": ["b"]}, 10.0 + 10 * round_, policy).state
    assert fresh.lone_blames == {} and set(fresh.members) == {"a"}


def test_the_min_replicas_guard_binds_every_verdict() -> None:
    """Singled out by every witness, or a lone blamer: none of them is evicted when that would leave fewer than
    ``min_replicas`` members; the epoch is re-formed instead, and says why."""
    for blame, members in (({"a": ["c"], "b": ["c"]}, ["a", "b", "c"]),
                           ({"a": ["b", "c"]}, ["a", "b", "c"])):
        policy = dataclasses.replace(P, max_reforms=1, min_replicas=3)
        state = boot(members, policy)
        for round_ in range(5):
            out = blame_round(state, blame, 10.0 + 10 * round_, policy)
            state = out.state
            assert not [e for e in out.events if isinstance(e, Died)], out.reason
            assert state.epoch is not None and state.epoch.replica_ids() == tuple(members)
        assert "none evicted (it would break the min-replicas guard)" in state.epoch.reason


def test_one_witness_never_convicts_more_than_one_suspect() -> None:
    """A lone witness blaming two of three others is not enough to evict both (the evidence is one member's
    word): at most one goes, as for blame nobody can attribute."""
    policy = dataclasses.replace(P, max_reforms=1)
    state = boot(["a", "b", "c", "d"], policy)
    blame = {"a": ["c", "d"]}
    state = blame_round(state, blame, 10.0, policy).state
    out = blame_round(state, blame, 20.0, policy)
    dead = [e.replica_id for e in out.events if isinstance(e, Died)]
    assert len(dead) == 1 and dead[0] in ("c", "d"), out.reason
    assert "not attributable" in out.reason


# --- end of job -----------------------------------------------------------------------------------------------


def leave(state: m.State, rid: str, now: float, *, reason: str = "finished", step: int = 0, n: int = 1,
          policy: m.Policy = P) -> m.Outcome:
    return apply(state, m.Leave(rid, inc(rid, n), reason, now, step=step), policy)


def test_a_finished_leave_records_the_jobs_final_step_the_highest_of_several() -> None:
    state = boot(["a", "b"])
    out = leave(state, "a", 1.0, step=100)
    assert out.state.finished_step == 100
    assert [(type(e), e.replica_id) for e in out.events] == [(Finished, "a")] and "finished the job at step 100" \
        in out.reason
    # b goes on alone (its epoch forms as usual) and finishes; the job's final step is the highest.
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("b",)
    assert leave(out.state, "b", 2.0, step=99).state.finished_step == 100
    out = leave(out.state, "b", 2.0, step=101)
    assert out.state.finished_step == 101 and out.state.members == {}
    # Another reason is a plain leave: nothing finishes.
    assert leave(boot(["a", "b"]), "a", 1.0, reason="stopped", step=100).state.finished_step is None
    assert leave(boot(["a", "b"]), "a", 1.0, reason="Finished", step=100).state.finished_step is None


def test_once_a_member_finished_the_min_replicas_guard_no_longer_holds_the_epoch() -> None:
    """Found by the simulator: with min_replicas 2, a member that left finished stayed in the guarded epoch, and
    the others' end-of-job barrier waited for it until its bound. Nothing trains past the last step, so nothing
    can split: the epoch of those left forms. Before the end, the guard holds as ever."""
    policy = dataclasses.replace(P, min_replicas=2)
    state = boot(["a", "b"], policy)
    out = leave(state, "a", 1.0, step=50, policy=policy)
    assert out.state.epoch is not None and out.state.epoch.replica_ids() == ("b",)
    held = leave(state, "a", 1.0, reason="stopped", step=50, policy=policy)
    assert held.state.epoch is not None and held.state.epoch.replica_ids() == ("a", "b")  # the guard held


def test_after_the_job_finished_a_registration_changes_nothing_and_is_told_finished() -> None:
    state = boot(["a", "b"])
    # b hung and was declared dead; then a finished and left.
    state = tick(state, 5.0, b=4.0).state
    assert set(state.members) == {"a"} and state.is_departed("b", inc("b"))
    state = leave(state, "a", 6.0, step=500).state
    assert state.finished_step == 500 and state.members == {}
    number = state.last_number
    for ev in (m.Register("b", inc("b", 2), 1, EP, 7.0),  # b restarted as a new incarnation
               m.Register("c", inc("c"), 1, EP, 7.0),  # a brand-new replica
               m.Register("b", inc("b", 1), 1, EP, 7.0)):  # the dead incarnation itself
        out = m.decide(state, ev, P)
        assert out.rejection is None and out.finished_step == 500
        assert out.state is state and out.events == ()
    assert state.last_number == number
    # Before the job finished, b's new incarnation would have been made active to resume alone.
    unfinished = dataclasses.replace(state, finished_step=None)
    out = m.decide(unfinished, m.Register("b", inc("b", 2), 1, EP, 7.0), P)
    assert out.finished_step is None and out.state.members["b"].role == m.ACTIVE


def test_after_the_job_finished_a_member_still_in_it_reconnects_and_works_as_before() -> None:
    state = boot(["a", "b"])
    state = leave(state, "a", 1.0, step=10).state
    out = m.decide(state, m.Register("b", inc("b"), 1, EP, 2.0), P)  # b's reconnect: idempotent
    assert out.rejection is None and out.finished_step is None and out.state is state
    # A joiner registered before the end keeps going while an active member is left: Ready works.
    state = boot(["a", "b", "c"])
    state = register(state, "j", 1.0).state
    state = leave(state, "a", 2.0, step=10).state
    state = apply(state, m.Ready("j", inc("j"), m.JOINING, 3.0)).state
    assert roles(state.epoch) == {"b": m.ACTIVE, "c": m.ACTIVE, "j": m.JOINING}
    state = apply(state, m.Ready("j", inc("j"), m.ACTIVE, 4.0)).state
    assert roles(state.epoch)["j"] == m.ACTIVE and state.finished_step == 10


def test_joiners_in_flight_are_dropped_once_the_last_active_member_finished() -> None:
    state = boot(["a", "b"])
    state = register(state, "j", 1.0).state
    state = apply(state, m.Ready("j", inc("j"), m.JOINING, 1.5)).state  # j syncs in the data plane
    state = register(state, "k", 1.6).state  # k waits outside it
    assert roles(state.epoch) == {"a": m.ACTIVE, "b": m.ACTIVE, "j": m.JOINING}
    numbers = [state.last_number]
    out = leave(state, "a", 2.0, step=300)
    assert set(out.state.members) == {"b", "j", "k"}  # b is still active: nobody is dropped yet
    state = out.state
    numbers.append(state.last_number)
    out = leave(state, "b", 3.0, step=301)
    state = out.state
    numbers.append(state.last_number)
    assert state.members == {} and state.finished_step == 301
    died = [e for e in out.events if isinstance(e, Died)]
    assert [(e.replica_id, e.cause, e.step) for e in died] == [("j", DeathCause.JOB_FINISHED, 301),
                                                               ("k", DeathCause.JOB_FINISHED, 301)]
    assert "the job finished at step 301" in out.reason and "guard" not in out.reason
    # Their incarnations are over: a heartbeat (or any call) is refused, naming the end of the job.
    for rid in ("j", "k"):
        assert state.is_departed(rid, inc(rid))
        rej = m.check_incarnation(state, rid, inc(rid))
        assert rej is not None and rej.code == "FAILED_PRECONDITION" and "finished at step 301" in rej.message
    # Nothing crashes afterwards, and epochs only go up (no epoch forms for a job with nobody left).
    for now in (4.0, 10.0, 100.0):
        state = tick(state, now).state
        numbers.append(state.last_number)
    assert numbers == sorted(numbers) and state.epoch is not None and state.epoch.number == numbers[-1]


def test_joiners_are_dropped_when_the_last_active_member_dies_after_the_job_finished() -> None:
    state = boot(["a", "b"])
    state = register(state, "j", 1.0).state
    state = leave(state, "a", 2.0, step=40).state
    assert set(state.members) == {"b", "j"}
    out = tick(state, 10.0, b=5.0)  # b dies without finishing: j has nothing left to join
    assert out.state.members == {} and out.state.finished_step == 40
    assert [(e.replica_id, e.cause) for e in out.events if isinstance(e, Died)] == \
        [("b", DeathCause.TIMEOUT), ("j", DeathCause.JOB_FINISHED)]
    # Without the end of the job, j would stay registered, waiting for an epoch.
    out = tick(dataclasses.replace(state, finished_step=None), 10.0, b=5.0)
    assert set(out.state.members) == {"j"}


def test_two_replicas_dead_at_once_cost_one_report_round_not_a_timeout() -> None:
    """b and c are SIGKILLed together; a's blame reports both against epoch 1. The first report forms epoch 2; the
    second, now against an older epoch, still counts because c is silent and a member of both: epoch 3 forms at
    once instead of after c's heartbeat timeout."""
    state = boot(["a", "b", "c"])
    first = report(state, "a", "b", 10.0, b=1.5, c=1.5)
    assert first.rejection is None and first.confirmed
    assert first.state.epoch is not None and first.state.epoch.replica_ids() == ("a", "c")
    second = report(first.state, "a", "c", 10.01, epoch=1, c=1.51)
    assert second.rejection is None and second.confirmed
    assert second.state.epoch is not None and second.state.epoch.replica_ids() == ("a",)
    assert second.state.epoch.number == 3


def test_two_replicas_that_died_at_once_are_confirmed_by_early_reports_on_their_closed_connections() -> None:
    """As above, but 20 ms after the kill (FTAR's early reports): neither is silent yet; both connections closed."""
    state = boot(["a", "b", "c"])
    first = report(state, "a", "b", 10.0, disconnected_s=0.02, early=True, b=0.05, c=0.05)
    assert first.confirmed and first.state.epoch is not None and first.state.epoch.replica_ids() == ("a", "c")
    second = report(first.state, "a", "c", 10.01, epoch=1, disconnected_s=0.03, early=True, c=0.06)
    assert second.rejection is None and second.confirmed
    assert second.state.epoch is not None and second.state.epoch.replica_ids() == ("a",)
    # Control: the same old report without the evidence is stale (c could be alive).
    stale = report(first.state, "a", "c", 10.01, epoch=1, early=True, c=0.06)
    assert stale.rejection is not None and stale.rejection.code == "FAILED_PRECONDITION"


def test_an_old_report_of_a_live_replica_stays_stale() -> None:
    state = boot(["a", "b", "c"])
    state = report(state, "a", "b", 10.0, b=1.5).state  # epoch 2: a, c
    out = report(state, "a", "c", 10.01, epoch=1)  # c heartbeats: it is alive, no re-form for an old report
    assert out.rejection is not None and out.rejection.code == "FAILED_PRECONDITION"
    assert "stale" in out.rejection.message
    assert out.state is state


def test_a_job_at_its_member_limit_refuses_a_new_replica_id_and_changes_nothing() -> None:
    """Issue 41: registrations that go silent cannot grow a job's members without bound; a member that registers
    again (a new incarnation of its id) still can, and a freed place is taken again."""
    pol = dataclasses.replace(P, max_members=3)
    s = m.State()
    for i, rid in enumerate(("a", "b", "c")):
        s = register(s, rid, now=float(i), policy=pol).state
    out = m.decide(s, m.Register("d", inc("d"), 1, EP, 3.0), pol)
    assert out.rejection is not None and out.rejection.code == "RESOURCE_EXHAUSTED" and out.state is s
    assert "limit of 3 members" in out.rejection.message
    again = register(s, "c", 3.0, n=2, policy=pol)
    assert again.rejection is None and again.state.members["c"].incarnation == inc("c", 2)
    left = m.decide(again.state, m.Leave("b", inc("b"), "bye", 4.0), pol)
    assert left.rejection is None and set(left.state.members) == {"a", "c"}
    assert register(left.state, "d", 5.0, policy=pol).rejection is None
    with pytest.raises(ValueError, match="max_members"):
        m.Policy(max_members=0)


def test_a_replica_of_another_layout_is_refused_and_changes_nothing() -> None:
    """Every replica of a job builds the same device mesh (rank r of each exchanges with rank r of the others):
    the first registration that names a layout sets the job's; one naming another is refused INVALID_ARGUMENT,
    with both layouts in the message, and the state is the same object; one naming none is not checked."""
    state = apply(m.State(), m.Register("a", inc("a"), 4, EP, 0.0, layout="dp2xtp2")).state
    assert state.layout == "dp2xtp2"
    out = m.decide(state, m.Register("b", inc("b"), 4, EP, 1.0, layout="dp4"), P)
    assert out.rejection is not None and out.rejection.code == "INVALID_ARGUMENT"
    assert "dp4" in out.rejection.message and "dp2xtp2" in out.rejection.message
    assert out.state is state
    same = apply(state, m.Register("b", inc("b"), 4, EP, 1.0, layout="dp2xtp2"))
    assert "b" in same.state.members
    assert apply(state, m.Register("c", inc("c"), 4, EP, 1.0)).state.layout == "dp2xtp2"
