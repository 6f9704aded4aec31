"""The stores' own guarantees that need no store process: URL parsing and the factory, and a typed error within
the deadline when etcd does not answer. (The conformance suite, run against every store, is
tests/integration/test_store_conformance.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from lighthouse.stores.factory import open_store
from tests.helpers.lighthouse import JOB


def doc(number: int, **extra: Any) -> dict[str, Any]:
    return {"last_number": number, "epoch": {"number": number, "members": [], "reason": "ünïcode ✓",
                                             "created_at": 1.5}, "history": [], **extra}


def test_etcd_url_parsing() -> None:
    from lighthouse.stores.etcd_client import DEFAULT_PREFIX, EtcdTarget

    t = EtcdTarget.parse("etcd://127.0.0.1:2379,[::1]:2380/jobs/a/")
    assert t.endpoints == (("127.0.0.1", 2379), ("::1", 2380)) and t.prefix == "/jobs/a"
    assert EtcdTarget.parse("etcd://h:1").prefix == DEFAULT_PREFIX
    for bad in ("etcd://", "etcd://host", "etcd://host:port", "http://h:1", "etcd://h:1,:2"):
        with pytest.raises(ValueError):
            EtcdTarget.parse(bad)
    with pytest.raises(ValueError, match="unsupported store"):
        open_store("redis://h:1")


def test_etcd_unreachable_is_a_typed_error_within_the_deadline() -> None:
    import time

    from fthsdp.testing.ports import free_port
    from lighthouse.errors import StoreUnavailable
    from lighthouse.stores.etcd import EtcdStore

    s = EtcdStore(f"etcd://127.0.0.1:{free_port()}/x", timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            s.load(JOB)
        with pytest.raises(StoreUnavailable):
            s.save(JOB, 0, doc(1))
        assert time.monotonic() - t0 < 5
    finally:
        s.close()


# --- TLS towards etcd: the options and the diagnosis of a refused connection (no etcd needed) -------------------


def test_etcd_tls_options_must_fit_together(tmp_path: Any) -> None:
    from lighthouse.config import etcd_tls_from_env
    from lighthouse.errors import SecurityConfigError
    from lighthouse.stores.etcd_tls import EtcdTLS

    assert EtcdTLS.from_options(None, "", None) is None  # nothing set: plaintext
    assert EtcdTLS.from_options("ca.pem", None, None) == EtcdTLS("ca.pem")  # server TLS only
    with pytest.raises(SecurityConfigError, match="go together"):
        EtcdTLS.from_options("ca.pem", "client.pem", None)
    with pytest.raises(SecurityConfigError, match="--etcd-ca"):
        EtcdTLS.from_options(None, "client.pem", "client.key")
    assert etcd_tls_from_env({}) is None
    assert etcd_tls_from_env({"FTHSDP_ETCD_CA": "a", "FTHSDP_ETCD_CERT": "b", "FTHSDP_ETCD_KEY": "c"}) == \
        EtcdTLS("a", "b", "c")
    with pytest.raises(SecurityConfigError, match="cannot read the etcd CA certificate"):
        EtcdTLS(str(tmp_path / "missing.pem")).credentials()
    with pytest.raises(ValueError, match="not etcd"):
        open_store("memory://", EtcdTLS("ca.pem"))


@pytest.mark.parametrize("detail,tls,hint", [
    # gRPC's words for each case, as seen against a real etcd run with --client-cert-auth:
    ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
     "Unwrap failed (TSI_DATA_CORRUPTED)", True, "requires a client certificate"),
    ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
     False, "serves TLS"),
    ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
     "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
     "unable to get local issuer certificate", True, "does not verify"),
    # a member down, or gone mid-call: not a configuration error
    ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
     "Connection refused", True, None),
    ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
     "Connection refused", False, None),
    ("UNAVAILABLE: Socket closed", False, None),
    ("DEADLINE_EXCEEDED: Deadline Exceeded", True, None),
])
def test_a_refused_handshake_is_told_from_a_member_down(detail: str, tls: bool, hint: str | None) -> None:
    from lighthouse.stores.etcd_client import access_hint

    got = access_hint(detail, tls)
    if hint is None:
        assert got is None
    else:
        assert got is not None and hint in got


def test_refused_access_is_a_typed_error_with_the_cause() -> None:
    """pyetcd raises a bare error from gRPC's: the store's error carries gRPC's reason, and once every member
    failed (pyetcd then answers 'no endpoint available' for a while) it still names the last real failure."""
    import grpc
    from pyetcd import exceptions as etcd_exc

    from lighthouse.errors import StoreAccessDenied
    from lighthouse.stores.etcd_client import failing_over

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Unwrap failed " \
                   "(TSI_DATA_CORRUPTED)"

    class Endpoint:
        secure = True

    class Client:
        endpoints = {"a:1": Endpoint(), "b:1": Endpoint()}

    client = Client()
    calls = {"n": 0}

    def refused() -> None:
        calls["n"] += 1
        try:
            raise Refused()
        except grpc.RpcError:
            raise etcd_exc.ConnectionFailedError()  # noqa: B904 (as pyetcd does: gRPC's error is only the context)

    def no_server() -> None:
        raise etcd_exc.NoServerAvailableError("No endpoint available and not failed")

    with pytest.raises(StoreAccessDenied, match="requires a client certificate.*TSI_DATA_CORRUPTED"):
        failing_over(client, "load", refused)
    assert calls["n"] == 2  # each member tried once
    with pytest.raises(StoreAccessDenied, match="the last failure: .*TSI_DATA_CORRUPTED"):
        failing_over(client, "load", no_server)
