"""The etcd client the etcd store and the election share: where etcd is (``EtcdTarget``), how to reach it over
TLS with a client certificate (``EtcdTLS``, for an etcd run with ``--client-cert-auth``), a failing-over client,
and what its calls raise when etcd cannot answer (``failing_over``: a ``StoreUnavailable`` whose message names
the cause, and a ``StoreAccessDenied`` when the TLS handshake, not the network, is what failed)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from lighthouse.errors import StoreAccessDenied, StoreUnavailable
from lighthouse.stores.etcd_tls import EtcdTLS

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


def connect(target: EtcdTarget, timeout_s: float = ETCD_TIMEOUT_S,
            tls: EtcdTLS | None = None) -> pyetcd.MultiEndpointEtcd3Client:
    """A pyetcd client over every endpoint, failing over between them (a failed one is retried after 1 s); over
    TLS (with a client certificate, when ``tls`` has one) or, without ``tls``, plaintext."""
    creds = tls.credentials() if tls is not None else None
    eps = [pyetcd.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=1.0)
           for host, port in target.endpoints]
    return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)


_TLS_FAILURES = ("handshake", "ssl_", "tsi_", "certificate")
"""Words of a gRPC connection failure that come from TLS, not from a member that is down. A plaintext client on a
TLS port reads instead 'failed to connect ... Socket closed' (the server hangs up on the first bytes)."""


def failure_detail(e: BaseException) -> str:
    """What a pyetcd error says, with gRPC's reason: pyetcd raises its own bare ``ConnectionFailedError`` from the
    gRPC error, whose details name the cause (refused, TLS handshake, certificate)."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, grpc.RpcError):
            code, details = x.code(), x.details()
            return f"{code.name if code else 'UNKNOWN'}: {details}"
    return repr(e)


def access_hint(detail: str, tls: bool) -> str | None:
    """Why a connection failure looks like TLS or client-certificate trouble rather than a member down, and what
    to give; None when it does not. Pure: decided on the failure's text and whether TLS is configured."""
    text = detail.lower()
    closed_at_connect = "failed to connect" in text and "socket closed" in text
    if not (any(w in text for w in _TLS_FAILURES) or closed_at_connect):
        return None
    if not tls:
        return ("etcd closed a plaintext connection: it likely serves TLS; give --etcd-ca, and --etcd-cert/"
                "--etcd-key when it requires client certificates (--client-cert-auth)")
    if "verify_failed" in text or "local issuer" in text or "self signed" in text:
        return "etcd's server certificate does not verify with --etcd-ca (wrong CA, or it does not name this host)"
    return ("etcd refused the TLS handshake: it requires a client certificate signed by its --trusted-ca-file "
            "(--etcd-cert/--etcd-key), and this one is missing or not signed by it")


_last_failure: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""Per client, the reason of its last connection failure: once every member failed, pyetcd answers the next calls
(for ``time_retry``) with a bare 'no endpoint available', and the reason would be lost."""


def failing_over(client: Any, what: str, call: Callable[[], T]) -> T:
    """Run ``call`` on ``client`` (from ``connect``), moving on to the next etcd member after a connection failure
    (pyetcd marks the failed one and picks another for the next call, but does not retry): each member is tried
    once. ``StoreUnavailable`` when none answers; ``StoreAccessDenied`` when what failed was TLS or the client
    certificate (``access_hint``), which waiting will not fix."""
    last: Exception | None = None
    for _ in range(max(1, len(client.endpoints))):
        try:
            return call()
        except ETCD_ERRORS as e:
            last = e
    detail = failure_detail(last) if last is not None else "no endpoint"
    if isinstance(last, etcd_exc.NoServerAvailableError) and client in _last_failure:
        detail = f"every member failed in the last second; the last failure: {_last_failure[client]}"
    else:
        _last_failure[client] = detail
    eps = client.endpoints
    tls = any(getattr(ep, "secure", False) for ep in (eps.values() if isinstance(eps, dict) else eps))
    hint = access_hint(detail, tls)
    if hint is not None:
        raise StoreAccessDenied(f"etcd {what} failed on every endpoint: {hint} ({detail})")
    raise StoreUnavailable(f"etcd {what} failed on every endpoint: {detail}")
