"""The etcd client the etcd store and the election share: where etcd is (``EtcdTarget``), a failing-over client,
and what its calls raise when etcd cannot answer."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

DEFAULT_PREFIX = "/fthsdp"
ETCD_TIMEOUT_S = 5.0
"""Deadline of one etcd call: a store call never waits longer."""
ETCD_ERRORS = (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError)
"""What a pyetcd call raises when etcd cannot answer (ValueError: pyetcd's 'failed node' when not failing over)."""


@dataclass(frozen=True)
class EtcdTarget:
    """Where the store lives: ``etcd://host:port[,host:port...][/prefix]``."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def parse(cls, url: str) -> EtcdTarget:
        if not url.startswith("etcd://"):
            raise ValueError(f"not an etcd URL: {url!r} (want etcd://host:port[,host:port...][/prefix])")
        rest = url[len("etcd://"):]
        hosts, _, prefix = rest.partition("/")
        endpoints: list[tuple[str, int]] = []
        for item in hosts.split(","):
            host, sep, port = item.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"bad etcd endpoint {item!r} in {url!r}: want host:port")
            endpoints.append((host.strip("[]"), int(port)))
        prefix = "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX
        return cls(tuple(endpoints), prefix)


def connect(target: EtcdTarget, timeout_s: float = ETCD_TIMEOUT_S) -> pyetcd.MultiEndpointEtcd3Client:
    """A pyetcd client over every endpoint, failing over between them (a failed one is retried after 1 s)."""
    eps = [pyetcd.Endpoint(host, port, secure=False, time_retry=1.0) for host, port in target.endpoints]
    return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)
