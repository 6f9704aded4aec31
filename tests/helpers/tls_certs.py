"""Throwaway test certificates made with the ``openssl`` command (nothing secret is committed): a CA, a server
certificate for 127.0.0.1/localhost, a client certificate signed by the CA, and a client certificate signed by
another CA (which the server must refuse); and the same for a TLS etcd (``make_etcd_certs``), whose members'
certificate serves both as server and as peer client."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_cert: str
    """A client certificate signed by a CA the server does not trust."""
    rogue_key: str
    rogue_ca: str


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: pathlib.Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: pathlib.Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make_certs(d: pathlib.Path, server_usage: str = "serverAuth") -> Certs:
    """``server_usage``: the server certificate's extended key usage (an etcd member's: ``serverAuth,clientAuth``,
    for it also dials its peers with it)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is missing: the TLS tests make their certificates with it")
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={server_usage}\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")

    def p(name: str) -> str:
        return str(d / name)

    return Certs(p("ca.pem"), p("server.pem"), p("server.key"), p("client.pem"), p("client.key"), p("rogue.pem"),
                 p("rogue.key"), p("rogue-ca.pem"))


def make_etcd_certs(d: pathlib.Path) -> Certs:
    """Certificates for a TLS etcd on 127.0.0.1 with client-certificate auth: ``server_*`` is every member's (server
    and peer), ``client_*`` the lighthouse's, ``rogue_*`` a client certificate from another CA."""
    return make_certs(d, server_usage="serverAuth,clientAuth")
