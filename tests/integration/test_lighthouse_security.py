"""The lighthouse's TLS, mTLS and job token, on gRPC and on the HTTP side port: a client with the wrong job, the
wrong token, no token or no (trusted) certificate is refused with a clear status and changes nothing; the right
one works, through the real clients and the real command line too."""

from __future__ import annotations

import json
import pathlib
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from tests.helpers.lighthouse import JOB, SLOW_POLICY, ServerThread
from tests.helpers.tls_certs import Certs, make_certs

from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from lighthouse.client import LighthouseClient
from lighthouse.errors import Unauthenticated
from lighthouse.security import (
    ClientSecurity,
    SecurityConfigError,
    ServerSecurity,
    read_token,
    security_from_env,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "s3cret-job-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    p = tmp_path_factory.mktemp("token") / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


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


def https_get(addr: str, path: str, *, token: str | None = None, ctx: ssl.SSLContext | None = None,
              basic: str | None = None) -> tuple[int, str, dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if basic is not None:
        import base64
        headers = {"Authorization": "Basic " + base64.b64encode(f"ops:{basic}".encode()).decode()}
    req = urllib.request.Request(f"{'https' if ctx else 'http'}://{addr}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


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
        code, details = refused(lambda: call(None))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "missing job token" in details
        for wrong in ("nope", TOKEN + "x", TOKEN[:-1], "Bearer " + TOKEN):
            code, details = refused(lambda: call(wrong))
            assert code == grpc.StatusCode.UNAUTHENTICATED and details == "wrong job token"
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
        code, _ = refused(lambda: reg(stub, "a", TOKEN))
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


# --- the command line ---------------------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fthsdp", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def test_cli_status_with_tls_and_token(start_server: Callable[..., ServerThread], certs: Certs,
                                       token_file: str) -> None:
    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, token=TOKEN))
    out = _cli("status", "--http", s.http, "--json", "--tls-ca", certs.ca, "--token-file", token_file)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["leader"] is True
    out = _cli("status", "--http", s.http, "--tls-ca", certs.ca)
    assert out.returncode != 0 and "HTTP 401" in out.stderr and "Bearer" in out.stderr


def test_cli_emulate_with_mtls_and_token_from_the_environment(start_server: Callable[..., ServerThread],
                                                             certs: Certs, token_file: str) -> None:
    import os

    from tests.helpers.lighthouse import wait_until

    from fthsdp.testing.procutil import stop_process

    s = start_server(SLOW_POLICY, security=ServerSecurity(certs.server_cert, certs.server_key, certs.ca, TOKEN))
    env = {**os.environ, "FTHSDP_TOKEN_FILE": token_file, "FTHSDP_TLS_CA": certs.ca,
           "FTHSDP_TLS_CERT": certs.client_cert, "FTHSDP_TLS_KEY": certs.client_key}
    proc = subprocess.Popen([sys.executable, "-m", "fthsdp", "emulate", "--lighthouse", s.addr, "--replicas", "3"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: len(s.state().members) == 3, timeout=30, what="3 emulated replicas registered")
        assert stop_process(proc, timeout=10) == 0  # type: ignore[arg-type]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_lighthouse_refuses_unusable_security_options(tmp_path: pathlib.Path, certs: Certs) -> None:
    out = _cli("lighthouse", "--bind", "127.0.0.1:0", "--http", "", "--no-rendezvous",
               "--token-file", str(tmp_path / "missing"))
    assert out.returncode != 0 and "cannot read token file" in out.stderr
    out = _cli("lighthouse", "--bind", "127.0.0.1:0", "--http", "", "--no-rendezvous", "--tls-cert", certs.server_cert)
    assert out.returncode != 0 and "go together" in out.stderr


def test_cli_lighthouse_process_with_mtls_and_token(tmp_path: pathlib.Path, certs: Certs, token_file: str) -> None:
    from fthsdp.testing.procutil import stop_process
    from fthsdp.testing.lighthouse_process import start_lighthouse_process

    proc, grpc_addr, http_addr = start_lighthouse_process(
        ["--no-rendezvous", "--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
         "--tls-client-ca", certs.ca, "--token-file", token_file], tmp_path)
    try:
        good = ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key, token_file)
        client = LighthouseClient(grpc_addr, JOB, "a", security=good)
        try:
            r = client.start(deadline_s=10)
            assert r is not None and r.epoch.number == 1
        finally:
            client.close()
        no_token = LighthouseClient(grpc_addr, JOB, "b", security=ClientSecurity(certs.ca, certs.client_cert,
                                                                                 certs.client_key))
        try:
            with pytest.raises(Unauthenticated, match="missing job token"):
                no_token.start(deadline_s=2)
        finally:
            no_token.close()
        code, body, _ = https_get(http_addr, "/status", ctx=good.ssl_context(), token=TOKEN)
        assert code == 200 and [x["replica_id"] for x in json.loads(body)["members"]] == ["a"]
    finally:
        assert stop_process(proc, timeout=15) == 0  # type: ignore[arg-type]
