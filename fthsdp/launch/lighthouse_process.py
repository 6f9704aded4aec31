"""Run a lighthouse as a child process on free loopback ports (the launcher, the demo and the benchmark do)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import urllib.request

from fthsdp.launch.procutil import wait_for_file
from lighthouse.config import security_from_env
from lighthouse.security import read_token


def start_lighthouse_process(args: list[str], workdir: pathlib.Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start ``fthsdp lighthouse`` on free loopback ports; return (process, grpc address, http address)."""
    port_file = workdir / "lighthouse.ports"
    with open(workdir / "lighthouse.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "fthsdp", "lighthouse", "--bind", "127.0.0.1:0",
                                 "--http", "127.0.0.1:0", "--port-file", str(port_file), *args],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        text = wait_for_file(port_file, timeout=60, proc=proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise
    ports = dict(kv.split("=", 1) for kv in text.split())
    return proc, f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}"


def http_get(http: str, path: str, credentials: str = "") -> bytes:
    """The body of a lighthouse's HTTP ``path`` at ``http``: over HTTPS when ``FTHSDP_TLS_CA`` is set (as for the
    replicas), with the read-only credential of a credentials folder (``fthsdp secrets``) when one is given."""
    headers = {}
    if credentials:
        headers["Authorization"] = f"Bearer {read_token(pathlib.Path(credentials) / 'reader.credential')}"
    tls = security_from_env().ssl_context()
    req = urllib.request.Request(f"{'https' if tls else 'http'}://{http}/{path}", headers=headers)
    with urllib.request.urlopen(req, timeout=5, context=tls) as r:
        return r.read()  # type: ignore[no-any-return]
