"""The lighthouse's TLS, mTLS and job token, on gRPC and on the HTTP side port: a client with the wrong job, the
wrong token, no token or no (trusted) certificate is refused with a clear status and changes nothing; the right
one works, through the real clients (in-process lighthouses; the command line is in
tests/integration/test_lighthouse_security.py)."""

from __future__ import annotations

import json
import pathlib
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lighthouse.client import LighthouseClient
from lighthouse.config import security_from_env
from lighthouse.errors import Unauthenticated
from lighthouse.security import ClientSecurity, SecurityConfigError, ServerSecurity, read_token
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, SLOW_POLICY, TOKEN, ServerThread, https_get
from tests.helpers.tls_certs import Certs


@pytest.fixture
def channels() -> Iterator[Callable[..., grpc.Channel]]:
    made: list[grpc.Channel] = []

    def make(addr: str, sec: ClientSecurity) -> grpc.Channel:
        ch = sec.channel(addr, aio=False)
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.close()


def md(token: str | None) -> tuple[tuple[str, str], ...]:
    return ClientSecurity(token=token).metadata()


def snapshot(stub: pb_grpc.LighthouseStub) -> tuple[Any, ...]:
    st = stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=md(TOKEN))
    return (st.epoch.number, tuple((x.replica_id, x.incarnation, x.role) for x in st.members),
            tuple(h.epoch for h in st.history))


def refused(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def reg(stub: pb_grpc.LighthouseStub, rid: str, token: str | None, job: str = JOB) -> pb.RegisterResponse:
    return stub.Register(pb.RegisterRequest(job_id=job, replica_id=rid, incarnation=f"{rid}-1", shard_count=1),
                         timeout=5, metadata=md(token))


# --- the token -----------------------------------------------------------------------------------------------------


def test_token_is_checked_on_every_call_and_refusals_change_nothing(
        start_server: Callable[..., ServerThread], channels: Callable[..., grpc.Channel]) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(token=TOKEN))
    stub = pb_grpc.LighthouseStub(channels(s.addr, ClientSecurity()))
    reg(stub, "a", TOKEN)
    before = snapshot(stub)
    calls: list[Callable[[str | None], Any]] = [
        lambda t: reg(stub, "b", t),
        lambda t: reg(stub, "a", t),  # a restart of a would form a new epoch
        lambda t: stub.Heartbeat(pb.HeartbeatRequest(job_id=JOB, replica_id="a", incarnation="a-1"), timeout=5,
                                 metadata=md(t)),
        lambda t: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation="a-1"), timeout=5,
                             metadata=md(t)),
        lambda t: stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="a", reporter_incarnation="a-1",
                                                      suspect_replica_id="a", epoch=1), timeout=5, metadata=md(t)),
        lambda t: stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="a", incarnation="a-1",
                                             role=pb.ROLE_ACTIVE), timeout=5, metadata=md(t)),
        lambda t: stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=md(t)),
        lambda t: list(stub.Watch(pb.WatchRequest(job_id=JOB), timeout=5, metadata=md(t))),
    ]
    for call in calls:
        code, details = refused(lambda call=call: call(None))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "missing job token" in details
        for wrong in ("nope", TOKEN + "x", TOKEN[:-1], "Bearer " + TOKEN):
            code, details = refused(lambda call=call, wrong=wrong: call(wrong))
            assert code == grpc.StatusCode.UNAUTHENTICATED and details == "wrong job token or credential"
        assert snapshot(stub) == before
    # Server reflection is behind the token too.
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    refl = reflection_pb2_grpc.ServerReflectionStub(channels(s.addr, ClientSecurity()))
    code, _ = refused(lambda: list(refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # The right token still works: the server kept serving.
    assert reg(stub, "b", TOKEN).role == pb.ROLE_JOINING
    assert [x[0] for x in snapshot(stub)[1]] == ["a", "b"]


def test_wrong_job_with_the_right_token_is_not_found_and_changes_nothing(
        start_server: Callable[..., ServerThread], channels: Callable[..., grpc.Channel]) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(token=TOKEN))
    stub = pb_grpc.LighthouseStub(channels(s.addr, ClientSecurity()))
    reg(stub, "a", TOKEN)
    before = snapshot(stub)
    code, details = refused(lambda: reg(stub, "b", TOKEN, job="other-job"))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown job" in details
    assert snapshot(stub) == before


def test_real_client_with_and_without_the_token(start_server: Callable[..., ServerThread]) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(token=TOKEN))
    bad = LighthouseClient(s.addr, JOB, "x", security=ClientSecurity(token="wrong"))
    try:
        with pytest.raises(Unauthenticated, match="wrong job token"):
            bad.start(deadline_s=2)
    finally:
        bad.close()
    assert s.state().members == {}
    good = LighthouseClient(s.addr, JOB, "y", security=ClientSecurity(token=TOKEN))
    try:
        r = good.start(deadline_s=5)
        assert r is not None and r.epoch.number == 1
        assert [x.replica_id for x in good.status().members] == ["y"]
    finally:
        good.close()


def test_token_file_is_validated(tmp_path: pathlib.Path, token_file: str) -> None:
    assert read_token(token_file) == TOKEN
    for content, why in ((b"", "empty"), (b"a b", "whitespace"), (b"\xff\xfe", "not ASCII"),
                         (b"x" * 5000, "over")):
        p = tmp_path / "t"
        p.write_bytes(content)
        with pytest.raises(SecurityConfigError, match=why):
            read_token(p)
    with pytest.raises(SecurityConfigError, match="cannot read"):
        read_token(tmp_path / "missing")
    with pytest.raises(SecurityConfigError, match="go together"):
        ServerSecurity(tls_cert="c")
    with pytest.raises(SecurityConfigError, match="needs --tls-ca"):
        ClientSecurity(tls_cert="c", tls_key="k")
    env = security_from_env({"FTHSDP_TOKEN_FILE": token_file, "FTHSDP_TLS_CA": "/ca.pem"})
    assert env == ClientSecurity(tls_ca="/ca.pem", token=TOKEN)
    assert security_from_env({}) == ClientSecurity()


# --- TLS and mTLS on gRPC ------------------------------------------------------------------------------------------


def test_tls_grpc_refuses_plaintext_and_serves_tls(start_server: Callable[..., ServerThread], certs: Certs,
                                                   channels: Callable[..., grpc.Channel]) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, token=TOKEN))
    plain = pb_grpc.LighthouseStub(channels(s.addr, ClientSecurity()))
    code, _ = refused(lambda: reg(plain, "a", TOKEN))
    assert code == grpc.StatusCode.UNAVAILABLE
    wrong_ca = pb_grpc.LighthouseStub(channels(s.addr, ClientSecurity(tls_ca=certs.rogue_ca)))
    code, _ = refused(lambda: reg(wrong_ca, "a", TOKEN))
    assert code == grpc.StatusCode.UNAVAILABLE  # the server's certificate is not trusted
    assert s.state().members == {}
    tls = pb_grpc.LighthouseStub(channels(s.addr, ClientSecurity(tls_ca=certs.ca)))
    code, details = refused(lambda: reg(tls, "a", None))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "missing job token" in details
    assert reg(tls, "a", TOKEN).epoch.number == 1


def test_mtls_grpc_needs_a_client_certificate_from_the_ca(start_server: Callable[..., ServerThread], certs: Certs,
                                                          channels: Callable[..., grpc.Channel]) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, certs.ca, TOKEN))
    for sec in (ClientSecurity(tls_ca=certs.ca, token=TOKEN),
                ClientSecurity(tls_ca=certs.ca, tls_cert=certs.rogue_cert, tls_key=certs.rogue_key, token=TOKEN)):
        stub = pb_grpc.LighthouseStub(channels(s.addr, sec))
        code, _ = refused(lambda stub=stub: reg(stub, "a", TOKEN))
        assert code == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    assert s.state().members == {}
    good = ClientSecurity(tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key, token=TOKEN)
    client = LighthouseClient(s.addr, JOB, "a", security=good)
    try:
        r = client.start(deadline_s=5)
        assert r is not None and r.epoch.number == 1
        # The watch stream runs over the same secured channel: a second replica's epoch reaches us.
        other = LighthouseClient(s.addr, JOB, "b", security=good)
        try:
            other.start(deadline_s=5)
            assert other.ready("joining") == 2  # a joiner entering the data plane forms epoch 2
            e = client.wait_epoch(after=1, timeout=10)
            assert e is not None and e.number == 2
        finally:
            other.close()
    finally:
        client.close()


# --- the HTTP side port -------------------------------------------------------------------------------------------


def test_http_side_port_tls_and_token(start_server: Callable[..., ServerThread], certs: Certs) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, token=TOKEN))
    ctx = ClientSecurity(tls_ca=certs.ca).ssl_context()
    assert ctx is not None
    for path in ("/status", "/metrics", "/", "/nope"):
        code, body, headers = https_get(s.http, path, ctx=ctx)
        assert code == 401 and "Bearer" in json.loads(body)["error"] and "Basic" in headers["WWW-Authenticate"]
        code, body, _ = https_get(s.http, path, ctx=ctx, token="wrong")
        assert code == 401 and "wrong job token" in json.loads(body)["error"]
    code, body, _ = https_get(s.http, "/status", ctx=ctx, token=TOKEN)
    assert code == 200 and json.loads(body)["leader"] is True
    code, body, _ = https_get(s.http, "/healthz", ctx=ctx)  # probes need no token, and learn nothing else
    assert code == 200 and json.loads(body) == {"ok": True}
    code, body, _ = https_get(s.http, "/metrics", ctx=ctx, token=TOKEN)
    assert code == 200 and 'code="UNAUTHENTICATED"' in body
    assert https_get(s.http, "/status", ctx=ctx, basic=TOKEN)[0] == 200  # a browser's prompt
    assert https_get(s.http, "/status", ctx=ctx, basic="wrong")[0] == 401
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        https_get(s.http, "/status", token=TOKEN)  # plain HTTP to the TLS port
    rogue = ssl.create_default_context(cafile=certs.rogue_ca)
    with pytest.raises(urllib.error.URLError):
        https_get(s.http, "/status", ctx=rogue, token=TOKEN)


def test_http_side_port_mtls(start_server: Callable[..., ServerThread], certs: Certs) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, certs.ca))
    no_cert = ClientSecurity(tls_ca=certs.ca).ssl_context()
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError, OSError)):
        https_get(s.http, "/status", ctx=no_cert)
    rogue = ClientSecurity(tls_ca=certs.ca, tls_cert=certs.rogue_cert, tls_key=certs.rogue_key).ssl_context()
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError, OSError)):
        https_get(s.http, "/status", ctx=rogue)
    good = ClientSecurity(tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key).ssl_context()
    code, body, _ = https_get(s.http, "/status", ctx=good)
    assert code == 200 and json.loads(body)["job"] == JOB


