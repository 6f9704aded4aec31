"""Prometheus metrics of one training process (one rank of one replica group).

Each rank owns a ``ReplicaMetrics``: its own registry (several can live in one process, as in tests), every
series labelled ``replica`` and ``rank``, and, when ``FTHSDP_METRICS_PORT`` is set, an HTTP exporter on
``FTHSDP_METRICS_PORT + LOCAL_RANK`` (so the ranks of one host do not collide; ``RuntimeConfig.metrics_port``
works it out) serving ``/metrics`` on ``FTHSDP_HOST``, at most ``EXPORTER_CONNECTIONS`` connections at once. The
runtime calls the typed ``on_*`` methods; they are cheap (a few counter updates, no I/O) and thread-safe.

Series (all prefixed ``fthsdp_replica_``):

- ``step`` (gauge): the last committed step; ``commits_total``: steps committed by this incarnation;
- ``epoch``, ``contributors`` (gauges): the epoch and the number of contributing replicas of the last commit;
- ``exchange_attempts`` (histogram): exchanges a committed step needed (1: no failure);
- ``retries_total{reason}``: exchanges abandoned and redone (peer failure, timeout, epoch change...);
- ``stall_seconds`` (histogram): per committed step, the time lost to failures (waiting for an epoch,
  abandoned exchanges); ``step_seconds`` (histogram): commit-to-commit time when the runtime reports it;
- ``catchup_bytes_total``, ``catchup_seconds`` (histogram; ``_count`` = catch-ups done): state a joiner
  fetched and how long it took; ``joining`` (gauge, 1 while this replica catches up);
- ``exchange_bytes_total``, ``exchange_seconds_total``: FTAR payload and time (throughput over a window:
  ``rate(exchange_bytes_total[1m]) / rate(exchange_seconds_total[1m])``); ``exchange_throughput_bytes_per_second``
  (gauge): the last exchange's;
- ``compute_seconds``, ``exchange_wait_seconds`` (histograms): per contributing step, the forward and backward
  (until the last bucket went to FTAR), and the wait after it until the step's last bucket came back: the
  replica the others wait on computes longest and waits least (fail-slow evidence, ``lighthouse.stragglers``).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import MetricsHandler

from ftar.devices import start_thread
from lighthouse.capped_http import CappedHTTPServer

PREFIX = "fthsdp_replica_"
_STALL_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_CATCHUP_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_ATTEMPT_BUCKETS = (1, 2, 3, 5, 10)


EXPORTER_CONNECTIONS = 8
"""Connections a rank's exporter serves at once (a scraper needs one); one more is closed at once."""
EXPORTER_TIMEOUT_S = 10.0
"""A connection that sends nothing this long is dropped."""


def exporter(addr: str, port: int, registry: CollectorRegistry) -> CappedHTTPServer:
    """prometheus_client's handler of ``registry`` on ``addr:port``, at most ``EXPORTER_CONNECTIONS`` connections at
    once, each dropped after ``EXPORTER_TIMEOUT_S`` of silence: scrapers and idle connections cannot pile up threads
    in a training process (``start_http_server`` has no cap)."""
    handler = type("Handler", (MetricsHandler,), {"registry": registry, "timeout": EXPORTER_TIMEOUT_S})
    return CappedHTTPServer((addr.strip("[]"), port), handler, max_connections=EXPORTER_CONNECTIONS)


class ReplicaMetrics:
    """Metrics of one rank. ``port``: serve ``/metrics`` there (0: any free port; None: no exporter), on ``addr``
    (the rank's ``FTHSDP_HOST``: loopback unless the operator names an address others reach)."""

    def __init__(self, replica: str, rank: int, port: int | None = None, addr: str = "127.0.0.1") -> None:
        self.registry = r = CollectorRegistry()
        labels = ["replica", "rank"]
        self.labels = {"replica": replica, "rank": str(rank)}

        def bind(metric: Any) -> Any:
            return metric.labels(**self.labels)

        self._step = bind(Gauge(PREFIX + "step", "Last committed step", labels, registry=r))
        self._commits = bind(Counter(PREFIX + "commits", "Steps committed by this incarnation", labels, registry=r))
        self._epoch = bind(Gauge(PREFIX + "epoch", "Epoch of the last commit (or the newest one seen)", labels,
                                 registry=r))
        self._contributors = bind(Gauge(PREFIX + "contributors", "Contributing replicas of the last commit",
                                        labels, registry=r))
        self._attempts = bind(Histogram(PREFIX + "exchange_attempts", "Exchanges a committed step needed",
                                        labels, buckets=_ATTEMPT_BUCKETS, registry=r))
        self._retries = Counter(PREFIX + "retries", "Exchanges abandoned and redone", labels + ["reason"],
                                registry=r)
        self._stall = bind(Histogram(PREFIX + "stall_seconds", "Time a committed step lost to failures", labels,
                                     buckets=_STALL_BUCKETS, registry=r))
        self._step_s = bind(Histogram(PREFIX + "step_seconds", "Commit-to-commit time", labels,
                                      buckets=_STEP_BUCKETS, registry=r))
        self._catchup_bytes = bind(Counter(PREFIX + "catchup_bytes", "State bytes fetched while catching up",
                                           labels, registry=r))
        self._catchup_s = bind(Histogram(PREFIX + "catchup_seconds", "Duration of a catch-up (fetch)", labels,
                                         buckets=_CATCHUP_BUCKETS, registry=r))
        self._joining = bind(Gauge(PREFIX + "joining", "1 while this replica catches up", labels, registry=r))
        self._xbytes = bind(Counter(PREFIX + "exchange_bytes", "FTAR payload bytes exchanged", labels, registry=r))
        self._xseconds = bind(Counter(PREFIX + "exchange_seconds", "Time spent in FTAR exchanges", labels,
                                      registry=r))
        self._xrate = bind(Gauge(PREFIX + "exchange_throughput_bytes_per_second",
                                 "Throughput of the last FTAR exchange", labels, registry=r))
        self._compute = bind(Histogram(PREFIX + "compute_seconds", "Forward and backward of a contributing step",
                                       labels, buckets=_STEP_BUCKETS, registry=r))
        self._wait = bind(Histogram(PREFIX + "exchange_wait_seconds", "Wait after the backward until the step's "
                                    "last bucket came back", labels, buckets=_STALL_BUCKETS, registry=r))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.address: str | None = None
        """Where the exporter listens (None: no exporter)."""
        if port is not None:
            self._server = exporter(addr, port, r)
            self._thread = start_thread(self._server.serve_forever, name="fthsdp-metrics", device=None, args=(0.1,))
            self.address, self.port = self._server.server_address[0], self._server.server_port

    # --- what the runtime reports -------------------------------------------------------------------------------

    def on_commit(self, step: int, epoch: int, contributors: int, attempts: int = 1, stall_s: float = 0.0,
                  step_s: float | None = None) -> None:
        """Step ``step`` was committed (the step counter is now ``step + 1``) in ``epoch``."""
        self._step.set(step)
        self._commits.inc()
        self._epoch.set(epoch)
        self._contributors.set(contributors)
        self._attempts.observe(attempts)
        self._stall.observe(max(0.0, stall_s))
        if step_s is not None:
            self._step_s.observe(max(0.0, step_s))

    def on_retry(self, reason: str = "failure") -> None:
        """An exchange was abandoned and will be redone (``reason``: a short fixed word, e.g. ``timeout``)."""
        self._retries.labels(**self.labels, reason=reason).inc()

    def on_epoch(self, epoch: int) -> None:
        """A newer epoch reached this rank."""
        self._epoch.set(epoch)

    def on_joining(self, joining: bool) -> None:
        self._joining.set(1 if joining else 0)

    def on_catchup(self, nbytes: int, seconds: float) -> None:
        """A catch-up finished: ``nbytes`` of state fetched in ``seconds``."""
        self._catchup_bytes.inc(max(0, nbytes))
        self._catchup_s.observe(max(0.0, seconds))

    def on_exchange(self, nbytes: int, seconds: float) -> None:
        """An FTAR exchange (one bucket or one step's worth) of ``nbytes`` took ``seconds``."""
        self._xbytes.inc(max(0, nbytes))
        self._xseconds.inc(max(0.0, seconds))
        if seconds > 0:
            self._xrate.set(nbytes / seconds)

    def on_pace(self, compute_s: float, wait_s: float) -> None:
        """A contributing step computed for ``compute_s`` and then waited ``wait_s`` for its exchange."""
        self._compute.observe(max(0.0, compute_s))
        self._wait.observe(max(0.0, wait_s))

    # --- exposition ---------------------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        """Stop the exporter (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
