"""The lighthouse on an etcd that serves TLS only and requires client certificates (``--client-cert-auth``, peers
too: deploy/k8s/etcd.yaml), started on 127.0.0.1 with certificates made here: with the right client certificate
the etcd store and the election work, in process and through ``fthsdp lighthouse``; without it (no certificate,
one from another CA, plaintext, the wrong CA) every call fails at once with a ``StoreAccessDenied`` that says what
to give, and ``fthsdp lighthouse`` exits saying so instead of serving. (The whole store conformance suite also runs
on this etcd: ``test_store_conformance.py``, kind ``etcd-tls``.)"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from fthsdp.launch.lighthouse_process import start_lighthouse_process
from fthsdp.launch.procutil import stop_process
from lighthouse.errors import StoreAccessDenied, StoreUnavailable
from lighthouse.stores.etcd_tls import EtcdTLS
from lighthouse.stores.factory import open_store
from tests.helpers.lighthouse import JOB, wait_until
from tests.helpers.tls_certs import Certs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def doc(number: int) -> dict[str, Any]:
    return {"last_number": number, "epoch": {"number": number, "members": [], "reason": "tls", "created_at": 1.0},
            "history": []}


def test_store_and_election_work_with_the_client_certificate(etcd_tls_server: tuple[Any, Certs]) -> None:
    server, c = etcd_tls_server
    url = server.url()
    store = open_store(url, EtcdTLS(c.ca, c.client_cert, c.client_key))
    try:
        store.check_access()
        store.save(JOB, 0, doc(1))
        assert store.load(JOB) == doc(1)
        changes: list[tuple[bool, str]] = []
        election = store.election("127.0.0.1:1", "", lambda leading, leader: changes.append((leading, leader)), 2)
        election.first_round()
        assert election.leading and changes == [(True, "127.0.0.1:1")]
        store.save(JOB, 1, doc(2))  # fenced on the leader key now: still writes
        election.stop()
        assert store.load(JOB) == doc(2)
    finally:
        store.close()


@pytest.mark.parametrize("who,expect", [
    ("no-client-cert", "requires a client certificate"),
    ("rogue-client-cert", "requires a client certificate"),
    ("plaintext", "serves TLS"),
    ("wrong-ca", "does not verify with --etcd-ca"),
])
def test_without_the_right_credentials_every_call_is_refused_clearly(etcd_tls_server: tuple[Any, Certs],
                                                                     who: str, expect: str) -> None:
    server, c = etcd_tls_server
    tls = {"no-client-cert": EtcdTLS(c.ca), "rogue-client-cert": EtcdTLS(c.ca, c.rogue_cert, c.rogue_key),
           "plaintext": None, "wrong-ca": EtcdTLS(c.rogue_ca, c.client_cert, c.client_key)}[who]
    url = server.url()
    store = open_store(url, tls)
    try:
        t0 = time.monotonic()
        for call in (store.check_access, lambda: store.load(JOB), lambda: store.save(JOB, 0, doc(1))):
            with pytest.raises(StoreAccessDenied, match=expect):
                call()
        assert time.monotonic() - t0 < 10  # a refused handshake is not waited out
    finally:
        store.close()
    good = open_store(url, EtcdTLS(c.ca, c.client_cert, c.client_key))
    try:
        assert good.load(JOB) is None  # nothing was written
    finally:
        good.close()


def test_a_member_down_is_unavailable_not_denied(tmp_path: pathlib.Path, etcd_tls_server: tuple[Any, Certs]) -> None:
    """The access check tells a refused handshake from nobody listening: the latter is the plain
    ``StoreUnavailable`` (the lighthouse starts and waits for etcd), not a configuration error."""
    from fthsdp.testing.ports import free_port

    _, c = etcd_tls_server
    store = open_store(f"etcd://127.0.0.1:{free_port()}/x", EtcdTLS(c.ca, c.client_cert, c.client_key))
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.check_access()
        assert not isinstance(info.value, StoreAccessDenied), info.value
    finally:
        store.close()


def _run_lighthouse(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fthsdp", "lighthouse", "--bind", "127.0.0.1:0", "--http", "",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_cli_without_a_client_certificate_exits_with_a_clear_error(etcd_tls_server: tuple[Any, Certs]) -> None:
    server, c = etcd_tls_server
    r = _run_lighthouse(["--store", server.url(), "--etcd-ca", c.ca])
    assert r.returncode != 0
    assert "requires a client certificate" in r.stderr and "--etcd-cert" in r.stderr, r.stderr
    r = _run_lighthouse(["--store", server.url()])  # plaintext towards a TLS etcd
    assert r.returncode != 0 and "serves TLS" in r.stderr, r.stderr
    r = _run_lighthouse(["--store", server.url(), "--etcd-ca", c.ca, "--etcd-cert", c.client_cert])
    assert r.returncode != 0 and "go together" in r.stderr, r.stderr
    r = _run_lighthouse(["--store", "memory://", "--etcd-ca", c.ca])
    assert r.returncode != 0 and "not etcd" in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["flags", "env"])
def test_cli_with_the_client_certificate_serves_and_leads(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                          etcd_tls_server: tuple[Any, Certs], how: str) -> None:
    server, c = etcd_tls_server
    args = ["--store", server.url(), "--election-ttl", "2"]
    if how == "flags":
        args += ["--etcd-ca", c.ca, "--etcd-cert", c.client_cert, "--etcd-key", c.client_key]
    else:  # the child inherits them
        monkeypatch.setenv("FTHSDP_ETCD_CA", c.ca)
        monkeypatch.setenv("FTHSDP_ETCD_CERT", c.client_cert)
        monkeypatch.setenv("FTHSDP_ETCD_KEY", c.client_key)
    proc, _grpc, http = start_lighthouse_process(args, tmp_path)
    try:
        def leads() -> bool:
            with urllib.request.urlopen(f"http://{http}/status", timeout=5) as r:
                return bool(json.load(r)["leader"])

        wait_until(leads, timeout=20, what="the lighthouse on the TLS etcd leads")
    finally:
        stop_process(proc, timeout=10)
