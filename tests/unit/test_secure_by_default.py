"""Closed by default off loopback (issue 41): the lighthouse refuses to serve a job open to the network (no job
token, or a token in clear) unless told ``--insecure``, and ``fthsdp secrets`` makes what closes it in one command."""

from __future__ import annotations

import pathlib
import stat
from collections.abc import Callable

import grpc
import pytest

from fthsdp.cli.main import build_parser
from fthsdp.launch.secrets import SecretsError, alt_names, make
from lighthouse.security import ClientSecurity, ServerSecurity, exposure, read_token
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, SLOW_POLICY, ServerThread

TOKEN_ONLY = ServerSecurity(token="t" * 32)
TLS_AND_TOKEN = ServerSecurity(tls_cert="server.pem", tls_key="server.key", token="t" * 32)


@pytest.mark.parametrize(("hosts", "security", "why"), [
    (["127.0.0.1", "localhost"], ServerSecurity(), None),  # the embedded default: this machine only
    (["[::1]"], ServerSecurity(), None),
    (["10.0.0.1"], ServerSecurity(), "no job token on '10.0.0.1'"),
    (["0.0.0.0"], ServerSecurity(), "no job token on '0.0.0.0'"),
    ([""], ServerSecurity(), "no job token on '*'"),  # every interface
    (["127.0.0.1", "10.0.0.1"], ServerSecurity(), "no job token on '10.0.0.1'"),  # the HTTP port counts too
    (["10.0.0.1"], TOKEN_ONLY, "no TLS on '10.0.0.1': the job token travels in clear"),
    (["10.0.0.1", "lh.example"], TLS_AND_TOKEN, None),
    (["127.0.0.1"], TOKEN_ONLY, None),
])
def test_what_leaves_a_job_open(hosts: list[str], security: ServerSecurity, why: str | None) -> None:
    got = exposure(hosts, security)
    assert (got == []) if why is None else (len(got) == 1 and got[0].startswith(why)), got


@pytest.mark.parametrize("extra", [[], ["--token-file", "TOKEN"]])
def test_the_lighthouse_refuses_to_serve_open_off_loopback_and_says_what_to_do(
        tmp_path: pathlib.Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32 + "\n")
    args = build_parser().parse_args(["lighthouse", "--bind", "0.0.0.0:0", "--http", "",
                                      *[str(token) if x == "TOKEN" else x for x in extra]])
    with pytest.raises(SystemExit) as e:
        args.fn(args)  # returns only by refusing: it never serves
    msg = str(e.value.code)
    assert msg.startswith("fthsdp lighthouse: refusing to serve the job open to the network: ")
    assert ("no TLS" if extra else "no job token") in msg
    assert "fthsdp secrets --out DIR --host NAME" in msg and "--insecure" in msg and "127.0.0.1" in msg


def test_an_http_port_off_loopback_is_refused_too(tmp_path: pathlib.Path) -> None:
    args = build_parser().parse_args(["lighthouse", "--bind", "127.0.0.1:0", "--http", "0.0.0.0:0"])
    with pytest.raises(SystemExit, match="no job token on '0.0.0.0'"):
        args.fn(args)


def test_alt_names() -> None:
    assert alt_names(["10.0.0.1", "lh.example", "[::1]"]) == "IP:10.0.0.1,DNS:lh.example,IP:::1"


@pytest.mark.parametrize("bad", [[], ["a b"], ["x,DNS:evil"], ["h:1"], [""]])
def test_bad_hosts_are_refused(bad: list[str]) -> None:
    with pytest.raises(SecretsError):
        alt_names(bad)


def test_fthsdp_secrets_makes_what_a_lighthouse_serves_tls_and_a_token_with(
        tmp_path: pathlib.Path, start_server: Callable[..., ServerThread]) -> None:
    """The folder is its owner's only; the token reads as a job token; a lighthouse serving with the certificate is
    reached over TLS by a client that trusts ``ca.pem`` and presents the token (and by no client without it)."""
    made = make(tmp_path / "job", ["127.0.0.1", "localhost"], days=2)
    folder = made.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == ["ca.key", "ca.pem", "reader.credential", "server.key",
                                                        "server.pem", "token"]
    assert all(stat.S_IMODE((folder / n).stat().st_mode) == 0o600
               for n in ("token", "ca.key", "server.key", "reader.credential"))
    token = read_token(made.path("token"))
    s = start_server(SLOW_POLICY, security=ServerSecurity.from_files(made.path("server.pem"), made.path("server.key"),
                                                                     token_file=made.path("token")))
    req = pb.RegisterRequest(job_id=JOB, replica_id="a", incarnation="a-1", shard_count=1)
    ok = ClientSecurity(tls_ca=made.path("ca.pem"), token=token)
    with ok.channel(s.addr, aio=False) as ch:
        assert pb_grpc.LighthouseStub(ch).Register(req, timeout=5, metadata=ok.metadata()).epoch.number == 1
    no_token = ClientSecurity(tls_ca=made.path("ca.pem"))
    with no_token.channel(s.addr, aio=False) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.LighthouseStub(ch).Register(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with pytest.raises(SecretsError, match="exists"):  # never overwritten
        make(folder, ["127.0.0.1"])
    assert read_token(made.path("token")) == token
