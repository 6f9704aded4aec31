"""``fthsdp secrets``: a job's credentials in one command, so that a lighthouse off loopback never has to run open.

It writes, into a new folder readable by its owner only: ``token`` (the job token, 256 random bits), ``ca.pem``
and ``ca.key`` (a private certificate authority for this job), and ``server.pem``/``server.key`` (the lighthouse's
certificate, for every ``--host`` name or address the replicas dial, signed by that CA). The lighthouse takes
``--token-file token --tls-cert server.pem --tls-key server.key``; the replicas ``FTHSDP_TOKEN_FILE=token`` and
``FTHSDP_TLS_CA=ca.pem``. Keys are EC P-256, made by the ``openssl`` command.

Given replica ids (``--replicas N``: ``replica-0`` .. ``replica-{N-1}``, the runtime's default ids; or
``--replica-id``), it also writes ``replicas/<id>.credential``, one per replica group: the group's own credential
(it can speak for that group only) and the job's catch-up key (``lighthouse.credentials``); give each group its
own file as ``FTHSDP_TOKEN_FILE`` and keep ``token`` on the lighthouse and with the operators. It always writes
``reader.credential``: read-only (``/status``, ``/metrics``, ``Status``), for Prometheus and dashboards.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import secrets
import shutil
import subprocess
from dataclasses import dataclass

from lighthouse import credentials
from lighthouse.validate import ID_RE

PRIVATE = ("token", "ca.key", "server.key", "reader.credential")
"""What only the folder's owner may read."""


class SecretsError(Exception):
    """The credentials could not be made (an existing folder, a bad host name, no ``openssl``)."""


@dataclass(frozen=True)
class JobSecrets:
    """Where ``make`` wrote a job's credentials."""

    folder: pathlib.Path

    def path(self, name: str) -> str:
        return str(self.folder / name)


def alt_names(hosts: list[str]) -> str:
    """The certificate's subjectAltName for ``hosts``: an IP entry for an address, a DNS entry for a name."""
    if not hosts:
        raise SecretsError("name at least one --host: the name or address the replicas dial the lighthouse at")
    out = []
    for h in hosts:
        h = h.strip().strip("[]")
        try:
            out.append(f"IP:{ipaddress.ip_address(h)}")
            continue
        except ValueError:
            pass
        if not h or any(c in h for c in ",/\\ \n:=") or len(h) > 253:
            raise SecretsError(f"--host {h!r}: not an IP address or a DNS name")
        out.append(f"DNS:{h}")
    return ",".join(out)


def _openssl(folder: pathlib.Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SecretsError(f"openssl {args[0]} failed: {done.stderr.strip()[-300:]}")


def replica_ids(count: int, named: list[str]) -> list[str]:
    """The replica groups to make credentials for: ``replica-0`` .. ``replica-{count-1}`` and ``named``."""
    if count < 0:
        raise SecretsError(f"--replicas must be >= 0, not {count}")
    ids = [f"replica-{i}" for i in range(count)] + list(named)
    if len(set(ids)) != len(ids):
        raise SecretsError(f"replica ids repeat: {ids}")
    for rid in ids:
        if not ID_RE.fullmatch(rid):
            raise SecretsError(f"--replica-id {rid!r} is not an id (letters, digits, '.', '_', ':', '-')")
    return ids


def make(folder: pathlib.Path, hosts: list[str], days: int = 365, *, job: str = "default",
         replicas: list[str] | None = None) -> JobSecrets:
    """Write a job's token, CA and lighthouse certificate into ``folder`` (created, mode 0700; it must not exist:
    credentials are never overwritten), a read-only credential, and a credential per replica group of
    ``replicas``."""
    if not ID_RE.fullmatch(job):
        raise SecretsError(f"--job {job!r} is not an id (letters, digits, '.', '_', ':', '-')")
    san = alt_names(hosts)
    replicas = replica_ids(0, replicas or [])
    if days < 1:
        raise SecretsError(f"--days must be >= 1, not {days}")
    if shutil.which("openssl") is None:
        raise SecretsError("the openssl command is missing: install it (Debian: apt-get install openssl)")
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        raise SecretsError(f"{folder} exists: choose a new folder (credentials are never overwritten)") from None
    old = os.umask(0o077)
    try:
        secret = secrets.token_urlsafe(32)
        (folder / "token").write_text(secret + "\n")
        (folder / "reader.credential").write_text(credentials.reader_credential(secret, job) + "\n")
        if replicas:
            (folder / "replicas").mkdir(mode=0o700)
            for rid in replicas:
                path = folder / "replicas" / f"{rid}.credential"
                path.write_text(credentials.credential_file(secret, job, rid))
                path.chmod(0o600)
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl(folder, "req", "-x509", *ec, "-days", str(days), "-subj", "/CN=fthsdp job CA", "-keyout", "ca.key",
                 "-out", "ca.pem", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        _openssl(folder, "req", *ec, "-subj", "/CN=fthsdp lighthouse", "-keyout", "server.key", "-out", "server.csr")
        (folder / "server.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
        _openssl(folder, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", str(days), "-extfile", "server.ext", "-out", "server.pem")
    finally:
        os.umask(old)
        for scratch in ("server.csr", "server.ext", "ca.srl"):
            (folder / scratch).unlink(missing_ok=True)
    for name in PRIVATE:
        (folder / name).chmod(0o600)
    return JobSecrets(folder)
