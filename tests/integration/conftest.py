"""The integration tests run in two lanes (``make test``: ``-n 2 --dist loadgroup``): the tests that train (real
replica groups filling the machine's cores) one at a time in one lane, and the control-plane tests (lighthouses,
etcd, manifests, a browser, emulated replicas: mostly waiting on deadlines) one at a time in the other, beside
them. Without pytest-xdist the marks change nothing."""

from __future__ import annotations

import pytest

CONTROL_PLANE = frozenset({
    "test_deploy.py", "test_store_conformance.py", "test_etcd_tls.py", "test_lighthouse_ha.py", "test_page.py",
    "test_lighthouse_security.py", "test_lighthouse_server.py", "test_lighthouse_evidence.py",
    "test_side_channels.py", "test_sim.py", "test_gpu_checks.py",
})
"""The files of the control-plane lane: none of their tests trains a model."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        lane = "control-plane" if item.path.name in CONTROL_PLANE else "training"
        item.add_marker(pytest.mark.xdist_group(lane))
