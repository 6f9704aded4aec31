"""The lighthouse's TLS, mTLS and job token through the real command line: ``fthsdp status`` and ``fthsdp emulate``
against a secured lighthouse, and ``fthsdp lighthouse`` refusing unusable options or serving with mTLS and a
token (the in-process checks are in tests/unit/test_lighthouse_security.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest

from lighthouse.client import LighthouseClient
from lighthouse.errors import Unauthenticated
from lighthouse.security import ClientSecurity, ServerSecurity
from tests.helpers.lighthouse import JOB, SLOW_POLICY, TOKEN, ServerThread, https_get
from tests.helpers.tls_certs import Certs

ROOT = pathlib.Path(__file__).resolve().parents[2]


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

    from fthsdp.launch.procutil import stop_process
    from tests.helpers.lighthouse import wait_until

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
    from fthsdp.launch.lighthouse_process import start_lighthouse_process
    from fthsdp.launch.procutil import stop_process

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
