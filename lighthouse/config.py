"""The settings of a lighthouse process (``LighthouseConfig``), and the one place the lighthouse package reads
the environment (``security_from_env``: how the launcher hands TLS and the job token to training processes;
``etcd_tls_from_env``: the lighthouse's TLS and client certificate towards etcd)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from lighthouse.lane_hosts import SPREAD_FROM
from lighthouse.model import Policy
from lighthouse.security import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN_FILE, ClientSecurity, ServerSecurity
from lighthouse.stores.etcd_tls import ENV_ETCD_CA, ENV_ETCD_CERT, ENV_ETCD_KEY, EtcdTLS


@dataclass(frozen=True)
class LighthouseConfig:
    """How to run a lighthouse. Addresses are ``host:port``; port 0 picks a free one."""

    bind: str = "127.0.0.1:29510"
    """The gRPC address to serve on."""
    http: str | None = "127.0.0.1:29511"
    """HTTP side port for /status, /metrics and the page at /; None: off."""
    jobs: tuple[str, ...] = ("default",)
    """Jobs this lighthouse serves; a request for any other job is NOT_FOUND."""
    policy: Policy = field(default_factory=Policy)
    """The membership rules (liveness, the split-brain guard, bootstrap)."""
    store: str = "memory://"
    """Where durable job state lives (``lighthouse.stores.factory.open_store``), unless a store object is
    given to the lighthouse: ``memory://`` or ``etcd://host:port[,host:port...][/prefix]`` (HA). An etcd that
    requires TLS and client certificates is opened by the caller (``open_store(url, etcd_tls)``, as ``fthsdp
    lighthouse`` does) and the store handed over."""
    rendezvous: bool = True
    """Host the epochs' data-plane rendezvous (so no replica holds it): the ``Rendezvous`` gRPC service, behind
    the same TLS and job token as the rest of the port."""
    member_rendezvous: bool = True
    """Let each lane's members host their rendezvous (``lighthouse.lane_hosts``): the lighthouse sends the epoch and
    serves only what the members cannot do alone (a newcomer's lookup of its host, a re-formed epoch). Off: every
    rank of every lane rendezvous on the lighthouse, as before (``--rendezvous-on lighthouse``)."""
    lane_spread_from: int = SPREAD_FROM
    """A lane of at least this many members that meets on the addresses its members kept meets on ``SPREAD`` of
    their stores at once (``lighthouse.lane_hosts.stores``), so that no one store serves every member; stamped on
    every epoch (``Epoch.lane_spread_from``), so the whole job uses one number (``--lane-spread-from``)."""
    insecure_tcp_rendezvous: bool = False
    """Host it on a plain TCPStore instead (no token, no TLS): an explicit opt-in, refused unless ``bind`` is a
    loopback address, and logged as a warning."""
    tick_s: float = 0.05
    """How often liveness is checked."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS (gRPC and HTTP) and the job token; the default is plaintext without a token (embedded use)."""
    advertise: str = ""
    """The gRPC address other lighthouses name as the leader's (HA); default: the bind host and bound port."""
    election_ttl_s: int = 5
    """HA on an etcd store: the leader's lease; a leader that stops answering is replaced within about this long."""
    election_probe_s: float = 0.25
    """HA on an etcd store: how often a follower knocks on the leader's gRPC port. Refused twice in a row by a
    port it reached before, the leader's process is gone, and the follower takes over at once instead of waiting
    for the lease (``lighthouse.stores.election``). 0: the lease alone."""
    probe_timeout_s: float = 1.0
    """A member whose session closed from its end gets one TCP connection to its catch-up endpoint, given this
    long: refused, it is dead at once (its process is gone; ``lighthouse.server.probe``). 0: never probe (a
    network where the lighthouse cannot reach the replicas' catch-up ports, or rejects with a reset)."""
    failover_grace_s: float | None = None
    """A lighthouse that takes over gives restored members this long on top of the heartbeat timeout to find
    it (clients back off and rotate addresses); None: one heartbeat timeout."""

    def __post_init__(self) -> None:
        if self.lane_spread_from < 2:
            raise ValueError(f"lane_spread_from={self.lane_spread_from} must be >= 2 (members of a lane)")

    @property
    def host(self) -> str:
        """The host part of ``bind``."""
        return self.bind.rsplit(":", 1)[0]


def security_from_env(env: Mapping[str, str] | None = None) -> ClientSecurity:
    """Client options from ``FTHSDP_TOKEN_FILE``, ``FTHSDP_TLS_CA``, ``FTHSDP_TLS_CERT``, ``FTHSDP_TLS_KEY``
    (unset or empty: off) — how the launcher hands them to the training processes."""
    e = os.environ if env is None else env
    return ClientSecurity.from_files(e.get(ENV_TLS_CA) or None, e.get(ENV_TLS_CERT) or None,
                                     e.get(ENV_TLS_KEY) or None, e.get(ENV_TOKEN_FILE) or None)


def etcd_tls_from_env(env: Mapping[str, str] | None = None) -> EtcdTLS | None:
    """The lighthouse's TLS towards etcd from ``FTHSDP_ETCD_CA``, ``FTHSDP_ETCD_CERT``, ``FTHSDP_ETCD_KEY``
    (unset or empty: off; ``fthsdp lighthouse --etcd-ca/--etcd-cert/--etcd-key`` win). None: plaintext;
    ``SecurityConfigError`` when the set ones do not fit together."""
    e = os.environ if env is None else env
    return EtcdTLS.from_options(e.get(ENV_ETCD_CA) or None, e.get(ENV_ETCD_CERT) or None, e.get(ENV_ETCD_KEY) or None)
