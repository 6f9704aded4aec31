"""Replica-side Prometheus metrics (fthsdp/runtime/metrics.py): what the runtime reports is what a scrape of the
exporter over loopback returns, labelled by replica and rank."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.metrics import EXPORTER_CONNECTIONS, ReplicaMetrics
from tests.helpers.lighthouse import wait_until

BASE_ENV = {"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "0", "FTHSDP_NUM_REPLICAS": "1",
            "FTHSDP_BACKEND": "gloo"}


def from_env(replica: str, rank: int, env: dict[str, str]) -> ReplicaMetrics:
    """The metrics as the runtime makes them: the port from the settings (``FTHSDP_METRICS_PORT + LOCAL_RANK``)."""
    return ReplicaMetrics(replica, rank, port=RuntimeConfig.from_env({**BASE_ENV, **env}).metrics_port,
                          addr="127.0.0.1")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def metrics() -> ReplicaMetrics:
    m = ReplicaMetrics("replica-3", 1, port=0, addr="127.0.0.1")
    yield m
    m.close()


def test_scrape_returns_what_was_reported(metrics: ReplicaMetrics) -> None:
    assert metrics.port
    lb = {"replica": "replica-3", "rank": "1"}
    metrics.on_commit(step=0, epoch=1, contributors=3, attempts=1, stall_s=0.0, step_s=0.2)
    metrics.on_retry("timeout")
    metrics.on_retry("timeout")
    metrics.on_retry("epoch_change")
    metrics.on_epoch(2)
    metrics.on_commit(step=1, epoch=2, contributors=2, attempts=3, stall_s=1.5)
    metrics.on_joining(True)
    metrics.on_catchup(4096, 2.0)
    metrics.on_exchange(1_000_000, 0.5)
    metrics.on_exchange(3_000_000, 0.5)
    s = scrape(metrics.port)
    assert value(s, "fthsdp_replica_step", **lb) == 1
    assert value(s, "fthsdp_replica_commits_total", **lb) == 2
    assert value(s, "fthsdp_replica_epoch", **lb) == 2
    assert value(s, "fthsdp_replica_contributors", **lb) == 2
    assert value(s, "fthsdp_replica_retries_total", **lb, reason="timeout") == 2
    assert value(s, "fthsdp_replica_retries_total", **lb, reason="epoch_change") == 1
    assert value(s, "fthsdp_replica_exchange_attempts_count", **lb) == 2
    assert value(s, "fthsdp_replica_exchange_attempts_sum", **lb) == 4
    assert value(s, "fthsdp_replica_exchange_attempts_bucket", **lb, le="1.0") == 1  # one step needed no retry
    assert value(s, "fthsdp_replica_stall_seconds_sum", **lb) == 1.5
    assert value(s, "fthsdp_replica_stall_seconds_bucket", **lb, le="0.0") == 1
    assert value(s, "fthsdp_replica_step_seconds_count", **lb) == 1
    assert value(s, "fthsdp_replica_joining", **lb) == 1
    assert value(s, "fthsdp_replica_catchup_bytes_total", **lb) == 4096
    assert value(s, "fthsdp_replica_catchup_seconds_count", **lb) == 1
    assert value(s, "fthsdp_replica_catchup_seconds_sum", **lb) == 2.0
    assert value(s, "fthsdp_replica_exchange_bytes_total", **lb) == 4_000_000
    assert value(s, "fthsdp_replica_exchange_seconds_total", **lb) == 1.0
    assert value(s, "fthsdp_replica_exchange_throughput_bytes_per_second", **lb) == 6_000_000
    # The scrape is live: a later report shows up in the next one.
    metrics.on_commit(step=2, epoch=2, contributors=3)
    s = scrape(metrics.port)
    assert value(s, "fthsdp_replica_step", **lb) == 2
    assert value(s, "fthsdp_replica_commits_total", **lb) == 3


def test_two_ranks_in_one_process_keep_separate_series() -> None:
    a = ReplicaMetrics("replica-0", 0, port=0, addr="127.0.0.1")
    b = ReplicaMetrics("replica-0", 1, port=0, addr="127.0.0.1")
    try:
        assert a.port != b.port
        a.on_commit(step=7, epoch=1, contributors=2)
        sa, sb = scrape(a.port), scrape(b.port)
        assert value(sa, "fthsdp_replica_commits_total", replica="replica-0", rank="0") == 1
        assert value(sb, "fthsdp_replica_commits_total", replica="replica-0", rank="1") == 0
        assert not any(dict(k[1]).get("rank") == "1" for k in sa)
    finally:
        a.close()
        b.close()


def _free_port_pair() -> int:
    """A port p such that p and p + 1 were both free just now (loopback)."""
    for _ in range(50):
        with socket.socket() as s1:
            s1.bind(("127.0.0.1", 0))
            p = s1.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
        return p
    pytest.fail("no two adjacent free ports")


def test_from_env_exports_on_base_port_plus_local_rank() -> None:
    base = _free_port_pair()
    m = from_env("replica-1", 5, {"FTHSDP_METRICS_PORT": str(base), "LOCAL_RANK": "1"})
    try:
        assert m.port == base + 1
        m.on_commit(step=4, epoch=3, contributors=2)
        assert value(scrape(base + 1), "fthsdp_replica_step", replica="replica-1", rank="5") == 4
    finally:
        m.close()
    with pytest.raises(urllib.error.URLError):  # closed: nothing listens any more
        scrape(base + 1)


def test_from_env_without_port_has_no_exporter_but_counts() -> None:
    m = from_env("replica-2", 0, {})
    assert m.port is None
    m.on_commit(step=0, epoch=1, contributors=1)
    assert b'fthsdp_replica_commits_total{rank="0",replica="replica-2"} 1.0' in m.render()
    m.close()


@pytest.mark.parametrize("env", [{"FTHSDP_METRICS_PORT": "ninety"}, {"FTHSDP_METRICS_PORT": "-5"},
                                 {"FTHSDP_METRICS_PORT": "65535", "LOCAL_RANK": "3"}])
def test_from_env_rejects_a_bad_port(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="FTHSDP_METRICS_PORT"):
        from_env("replica-0", 0, env)


def test_the_exporter_listens_on_loopback_unless_told_an_address() -> None:
    """Issue 41: the ranks' exporters bound every interface; now ``FTHSDP_HOST`` (loopback by default)."""
    m = ReplicaMetrics("replica-0", 0, port=0)
    try:
        assert m.address == "127.0.0.1"
    finally:
        m.close()



def test_the_exporter_serves_a_bounded_number_of_connections_and_recovers() -> None:
    """Issue 41: each connection cost the exporter a thread, without a cap; now one past ``EXPORTER_CONNECTIONS``
    is closed at once, and the exporter serves again when the idle ones are gone."""
    m = ReplicaMetrics("replica-0", 0, port=0)
    idle: list[socket.socket] = []
    try:
        assert m.port is not None and m._server is not None
        idle = [socket.create_connection(("127.0.0.1", m.port), timeout=10) for _ in range(EXPORTER_CONNECTIONS)]
        wait_until(lambda: m._server.free == 0, 10, what="the idle connections taken in")
        extra = socket.create_connection(("127.0.0.1", m.port), timeout=5)
        assert extra.recv(1) == b""  # closed at once
        extra.close()
        assert m._server.refused == 1
        for s in idle:
            s.close()
        wait_until(lambda: m._server.free == EXPORTER_CONNECTIONS, 10, what="the places given back")
        with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"fthsdp_replica_step" in r.read()
    finally:
        for s in idle:
            s.close()
        m.close()
