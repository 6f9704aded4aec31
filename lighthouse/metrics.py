"""Prometheus metrics of a lighthouse (its own registry, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from lighthouse.events import replica_kinds
from lighthouse.model import ROLES, State


class LighthouseMetrics:
    """The lighthouse's counters and gauges; ``render`` gives the Prometheus text of ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.epoch = Gauge("fthsdp_lighthouse_epoch", "Current epoch number", ["job"], registry=r)
        self.members = Gauge("fthsdp_lighthouse_members", "Live registered replicas", ["job", "role"], registry=r)
        self.epoch_changes = Counter("fthsdp_lighthouse_epoch_changes", "Epochs formed", ["job"], registry=r)
        self.heartbeats = Counter("fthsdp_lighthouse_heartbeats", "Heartbeats accepted", registry=r)
        self.reports = Counter("fthsdp_lighthouse_failure_reports", "Failure reports by outcome", ["result"],
                               registry=r)
        self.rpc_errors = Counter("fthsdp_lighthouse_rpc_errors", "Refused requests", ["method", "code"],
                                  registry=r)
        self.watchers = Gauge("fthsdp_lighthouse_watchers", "Open epoch watch streams", registry=r)
        self.sessions = Gauge("fthsdp_lighthouse_sessions", "Open replica-group sessions (heartbeats and epochs)",
                              registry=r)
        self.streams_opened = Counter("fthsdp_lighthouse_streams_opened", "Sessions and watch streams opened",
                                      ["kind"], registry=r)
        self.leader = Gauge("fthsdp_lighthouse_leader", "1 while this lighthouse leads (always, without HA)",
                            registry=r)
        self.store_errors = Counter("fthsdp_lighthouse_store_errors", "Store writes that failed",
                                    ["job", "kind"], registry=r)
        self.rendezvous_calls = Counter("fthsdp_lighthouse_rendezvous_calls", "Data-plane rendezvous calls served "
                                        "(per-rank traffic: none after a death when the lanes' members host it)",
                                        ["job"], registry=r)
        self.membership_events = Counter("fthsdp_lighthouse_membership_events", "Replica failures, rejoins, "
                                         "leaves and joins named by the epochs formed", ["job", "kind"], registry=r)

    def observe_epoch(self, job: str, state: State) -> None:
        """``state``'s epoch is current for ``job``: count it and the membership events that formed it."""
        epoch = state.epoch
        self.epoch.labels(job).set(epoch.number if epoch is not None else 0)
        if epoch is not None:
            self.epoch_changes.labels(job).inc()
            if epoch.number > 1:  # 1: bootstrap
                for _, kind in replica_kinds(epoch.events):
                    self.membership_events.labels(job, kind).inc()
        for role in ROLES:
            self.members.labels(job, role).set(sum(1 for x in state.members.values() if x.role == role))

    def rpc_error(self, method: str, code: str) -> None:
        self.rpc_errors.labels(method, code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
