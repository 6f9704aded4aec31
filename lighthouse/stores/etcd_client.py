"""The etcd client the etcd store and the election share: where etcd is (``EtcdTarget``), a failing-over client,
and what its calls raise when etcd cannot answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from lighthouse.errors import StoreUnavailable

T = TypeVar("T")

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


def failing_over(client: Any, what: str, call: Callable[[], T]) -> T:
    """Run ``call`` on ``client`` (from ``connect``), moving on to the next etcd member after a connection failure
    (pyetcd marks the failed one and picks another for the next call, but does not retry): each member is tried
    once. StoreUnavailable when none answers."""
    last: Exception | None = None
    for _ in range(max(1, len(client.endpoints))):
        try:
            return call()
        except ETCD_ERRORS as e:
            last = e
    raise StoreUnavailable(f"etcd {what} failed on every endpoint: {last!r}")
