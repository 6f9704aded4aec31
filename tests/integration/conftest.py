"""The integration tests run in two lanes (``make test``: ``-n 2``): the tests that train (real replica groups
filling the machine's cores) one at a time in one pytest-xdist worker, and the light ones one at a time in the
other, beside them: the control-plane tests (lighthouses, etcd, manifests, a browser, emulated replicas: mostly
waiting on deadlines) and the trainings of one rank per group whose steps are paced (their processes mostly sleep,
and what they check counts steps, not seconds). Without pytest-xdist this changes nothing."""

from __future__ import annotations

from typing import Any

CONTROL_PLANE = frozenset({
    "test_deploy.py", "test_store_conformance.py", "test_etcd_tls.py", "test_lighthouse_ha.py", "test_page.py",
    "test_lighthouse_security.py", "test_lighthouse_server.py", "test_lighthouse_evidence.py",
    "test_side_channels.py", "test_sim.py", "test_gpu_checks.py",
})
"""The files of the control-plane tests: none of them trains a model."""

PACED_ONE_RANK = frozenset({
    "test_chaos.py::test_ha_leader_lighthouse_killed_training_goes_on",
    "test_chaos.py::test_replica_back_after_the_job_finished_ends_cleanly",
    "test_user_script.py::test_fthsdp_run_one_group_per_host_against_a_shared_lighthouse",
    "test_catchup_e2e.py::test_every_replica_dies_job_resumes_from_checkpoint",
})
"""Files (or single tests) that train one rank per replica group with paced steps, or wait out a restart delay:
light beside a training."""


def lane(nodeid: str) -> str:
    """The lane of the test ``nodeid``: "light" (``CONTROL_PLANE``, ``PACED_ONE_RANK``) or "training"."""
    path, _, name = nodeid.partition("::")
    file = path.rsplit("/", 1)[-1]
    test = f"{file}::{name.split('[', 1)[0]}"
    light = file in CONTROL_PLANE or file in PACED_ONE_RANK or test in PACED_ONE_RANK
    return "light" if light else "training"


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's scope scheduler with a lane as the scope: each lane's tests go to one worker, in order.
    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8 writes the group into
    a test id that pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Lanes(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)
