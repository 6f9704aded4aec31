"""Real etcd on loopback for the tests and the chaos runs: ``members`` etcd processes forming one cluster on free
ports in a working directory, waited for with a deadline, stopped by PID. A member can be SIGKILLed, or the whole
cluster stopped, and started again on the same ports and data dir (what was written survives). Fails (never skips)
when the ``etcd`` binary is missing: ``make setup`` installs Debian's ``etcd-server``. With ``EtcdServerTLS`` the
members serve clients and peers over TLS and require client and peer certificates (``--client-cert-auth``), as
deploy/k8s/etcd.yaml does."""

from __future__ import annotations

import pathlib
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from fthsdp.launch.procutil import stop_process
from fthsdp.testing.ports import free_port

ETCD_BINARY_CANDIDATES = ("etcd", "/usr/bin/etcd")
START_DEADLINE_S = 30.0
START_ATTEMPTS = 3
"""A free port can be taken between probing it and etcd binding it: start again on new ports this many times."""


@dataclass(frozen=True)
class EtcdServerTLS:
    """PEM files of a TLS etcd: each member serves clients and peers with ``cert``/``key`` (naming 127.0.0.1,
    for server and client use), and trusts and requires certificates signed by ``ca`` from clients and peers.
    ``client_cert``/``client_key`` are what the launcher's health check presents."""

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str

    def flags(self) -> list[str]:
        """etcd's options for it: TLS and certificate auth on the client and the peer port."""
        return ["--cert-file", self.cert, "--key-file", self.key, "--trusted-ca-file", self.ca, "--client-cert-auth",
                "--peer-cert-file", self.cert, "--peer-key-file", self.key, "--peer-trusted-ca-file", self.ca,
                "--peer-client-cert-auth"]

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class EtcdUnavailable(RuntimeError):
    """The etcd binary is missing, or a member did not become healthy in time."""


def find_etcd() -> str:
    for c in ETCD_BINARY_CANDIDATES:
        path = shutil.which(c)
        if path:
            return path
    raise EtcdUnavailable("the etcd binary is missing: install Debian's etcd-server (make setup runs "
                          "scripts/system-deps.sh) — the etcd store tests and HA chaos runs need a real etcd")


class EtcdCluster:
    """``members`` etcd processes forming one cluster on loopback (one member: a single etcd server)."""

    def __init__(self, workdir: pathlib.Path, members: int = 1, tls: EtcdServerTLS | None = None) -> None:
        self.workdir = workdir
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.binary = find_etcd()
        self.names = [f"e{i}" for i in range(members)]
        self.ports: list[tuple[int, int]] = []
        """(client, peer) port of each member."""
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.token = "fthsdp-" + uuid.uuid4().hex[:8]

    @property
    def client_port(self) -> int:
        return self.ports[0][0]

    @property
    def endpoint(self) -> str:
        """The first member's client address."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{c}" for c, _ in self.ports)

    def url(self, prefix: str | None = None) -> str:
        """An ``etcd://`` store URL over every member; a fresh prefix per call unless given, so that tests never see
        each other's keys."""
        return f"etcd://{self.endpoints}/{prefix or 'test-' + uuid.uuid4().hex[:12]}"

    def start(self, deadline_s: float = START_DEADLINE_S) -> EtcdCluster:
        """Start every member on new free ports and wait until all are healthy."""
        for _attempt in range(START_ATTEMPTS):
            self.ports = [(free_port(), free_port()) for _ in self.names]
            for i in range(len(self.names)):
                self._launch(i)
            try:
                self.wait_healthy(range(len(self.names)), deadline_s)
                return self
            except EtcdUnavailable:
                self.stop()
        raise EtcdUnavailable(f"etcd did not become healthy within {deadline_s}s, {START_ATTEMPTS} times: "
                              + self._log_path(0).read_text(errors="replace")[-2000:])

    def _log_path(self, i: int) -> pathlib.Path:
        return self.workdir / f"etcd-{self.names[i]}.log"

    def _launch(self, i: int) -> None:
        client, peer = self.ports[i]
        http = self.scheme
        initial = ",".join(f"{n}={http}://127.0.0.1:{p}" for n, (_, p) in zip(self.names, self.ports, strict=True))
        with open(self._log_path(i), "ab") as out:  # the child keeps its own copy of the descriptor
            self.procs[i] = subprocess.Popen([
                self.binary, "--name", self.names[i],
                "--data-dir", str(self.workdir / f"etcd-{self.names[i]}-data-{client}"),
                "--listen-client-urls", f"{http}://127.0.0.1:{client}",
                "--advertise-client-urls", f"{http}://127.0.0.1:{client}",
                "--listen-peer-urls", f"{http}://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"{http}://127.0.0.1:{peer}",
                *(self.tls.flags() if self.tls is not None else []),
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.token,
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--logger", "zap", "--log-level", "warn"], stdout=out, stderr=subprocess.STDOUT)

    def healthy(self, i: int) -> bool:
        try:
            ctx = self.tls.ssl_context() if self.tls is not None else None
            with urllib.request.urlopen(f"{self.scheme}://127.0.0.1:{self.ports[i][0]}/health", timeout=1,
                                        context=ctx) as r:
                return b'"true"' in r.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, members: Iterable[int], deadline_s: float) -> None:
        """Wait until each of ``members`` answers healthy; raise if one exits or at the deadline."""
        end = time.monotonic() + deadline_s
        pending = set(members)
        while pending:
            for i in list(pending):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise EtcdUnavailable(f"etcd member {self.names[i]} exited with {p.returncode} (log: "
                                          f"{self._log_path(i)})")
                if self.healthy(i):
                    pending.discard(i)
            if pending and time.monotonic() > end:
                raise EtcdUnavailable(f"etcd members {sorted(pending)} not healthy within {deadline_s}s")
            if pending:
                time.sleep(0.05)  # polling a condition with a deadline

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a chaos fault)."""
        p = self.procs[i]
        if p is not None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
        self.procs[i] = None

    def restart(self, member: int | None = None, wait: bool = True) -> EtcdCluster:
        """Start again a killed member (or, with no ``member``, every stopped one) on its ports and data dir;
        with ``wait``, until healthy."""
        down = [i for i, p in enumerate(self.procs) if p is None] if member is None else [member]
        assert self.ports and all(self.procs[i] is None for i in down), "restart: the member still runs"
        for i in down:
            self._launch(i)
        if wait:
            self.wait_healthy(down, START_DEADLINE_S)
        return self

    def stop(self) -> None:
        """SIGTERM every live member at once (then SIGKILL at the deadline)."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            stop_process(p, timeout=10)
        self.procs = [None] * len(self.procs)
