"""The integration tests run in two lanes (``make test``: ``-n 2``): the tests that train (real replica groups
filling the machine's cores) one at a time in one pytest-xdist worker, and the light ones one at a time in the
other, beside them: the control-plane tests (lighthouses, etcd, manifests, a browser, emulated replicas: mostly
waiting on deadlines) and the trainings of one rank per group whose steps are paced (their processes mostly sleep,
and what they check counts steps, not seconds). The training lane runs the tests that judge times last. Trainings
of several ranks stay out of the light lane: tried, the golden-loss trainings there took twice as long, the training
lane was no shorter (30:13 against 30:40) and two of its tests failed (a standby not ready in time, a straggler
named on the loaded host). The one-rank paced trainings are the other way round: ``test_state_travels.py`` in the
light lane took the integration tests from 28:04 to 25:14 (fresh-clone runs, 2026-12-05). Without pytest-xdist
only the order changes."""

from __future__ import annotations

from typing import Any

CONTROL_PLANE = frozenset({
    "test_deploy.py", "test_store_conformance.py", "test_etcd_tls.py", "test_lighthouse_ha.py", "test_page.py",
    "test_lighthouse_security.py", "test_lighthouse_server.py", "test_lighthouse_evidence.py",
    "test_side_channels.py", "test_sim.py", "test_gpu_checks.py",
})
"""The files of the control-plane tests: none of them trains a model."""

PACED_ONE_RANK = frozenset({
    "test_state_travels.py",
    "test_chaos.py::test_ha_leader_lighthouse_killed_training_goes_on",
    "test_chaos.py::test_replica_back_after_the_job_finished_ends_cleanly",
    "test_user_script.py::test_fthsdp_run_one_group_per_host_against_a_shared_lighthouse",
    "test_catchup_e2e.py::test_every_replica_dies_job_resumes_from_checkpoint",
    "test_selfcheck.py::test_a_group_that_fails_its_self_check_at_the_start_does_not_hold_the_first_epoch",
    "test_late_joiner.py::test_under_train_step_it_still_reports_the_final_state_it_took",
})
"""Files (or single tests) that train one rank per replica group with paced steps, or wait out a restart delay:
light beside a training. Where such a test needs a replica to restart and rejoin before the end, a cold restart
beside the training lane's can take 47 s (``test_state_travels.py``, once): the others hold for it
(``FTHSDP_FAULT_HOLD_UNTIL``) instead of counting on their pace."""

ALONE_AT_THE_END = (
    "test_chaos.py::test_seeded_chaos_run_keeps_every_invariant",
    "test_catchup_e2e.py::test_survivors_do_not_wait_while_a_replica_catches_up",
    "test_stragglers.py::test_a_replica_three_times_slower_is_named_within_ten_steps_and_nobody_before",
    "test_stragglers.py::test_one_slow_rank_of_a_replica_is_named_with_its_rank_within_ten_steps",
    "test_stragglers.py::test_a_slow_link_is_named_as_a_link_with_its_rank_within_ten_steps",
    "test_stragglers.py::test_under_eject_the_straggler_leaves_is_held_out_while_slow_and_the_others_go_on",
    "test_rank_faults.py::test_one_rank_stopped_alone_restarts_its_replica_within_the_collective_timeout",
    "test_rank_faults.py::test_one_rank_killed_alone_restarts_its_replica",
    "test_lane_hosts.py::test_killing_a_lanes_host_moves_its_lanes_to_the_next_host_and_only_it_pays",
)
"""Training-lane tests whose checks are times or a detector's judgement of speed (a stall within a bound, nobody
named slow before the slowed one): the training lane runs them last, when the light lane is done and the machine
is theirs (about 20 minutes in; the light lane takes about 14)."""

LAST = {name: i for i, name in enumerate(ALONE_AT_THE_END)}


def _test(nodeid: str) -> tuple[str, str]:
    """(file, file::test without its parameters) of ``nodeid``."""
    path, _, name = nodeid.partition("::")
    file = path.rsplit("/", 1)[-1]
    return file, f"{file}::{name.split('[', 1)[0]}"


def lane(nodeid: str) -> str:
    """The lane of the test ``nodeid``: "light" (``CONTROL_PLANE``, ``PACED_ONE_RANK``) or "training"."""
    file, test = _test(nodeid)
    light = file in CONTROL_PLANE or file in PACED_ONE_RANK or test in PACED_ONE_RANK
    return "light" if light else "training"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """``ALONE_AT_THE_END`` last, in their listed order: each lane runs its tests in collection order."""
    items.sort(key=lambda item: LAST.get(_test(item.nodeid)[1], -1))  # stable: the others keep their order


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's scope scheduler with a lane as the scope: each lane's tests go to one worker, in order.
    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8 writes the group into
    a test id that pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Lanes(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)
