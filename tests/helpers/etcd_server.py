"""A real etcd server for tests: started on free loopback ports in a temporary data dir, waited for with a deadline,
stopped by PID. Fails (never skips) when the ``etcd`` binary is missing: ``make setup`` installs Debian's
``etcd-server``."""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid

ETCD_BINARY_CANDIDATES = ("etcd", "/usr/bin/etcd")
START_DEADLINE_S = 30.0


def find_etcd() -> str:
    for c in ETCD_BINARY_CANDIDATES:
        path = shutil.which(c)
        if path:
            return path
    raise RuntimeError("the etcd binary is missing: install Debian's etcd-server (make setup runs "
                       "scripts/system-deps.sh) — the etcd store tests need a real etcd")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One single-member etcd cluster on loopback."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.binary = find_etcd()
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str | None = None) -> str:
        """An ``etcd://`` store URL; a fresh prefix per call unless given, so tests never see each other's keys."""
        return f"etcd://{self.endpoint}/{prefix or 'test-' + uuid.uuid4().hex[:12]}"

    def start(self) -> EtcdServer:
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between probing it and etcd binding it
            self.client_port, self.peer_port = free_port(), free_port()
            if self._launch():
                return self
            self.stop()
            last_error = self._log_path().read_text(errors="replace")[-2000:]
        raise RuntimeError(f"etcd did not become healthy within {START_DEADLINE_S}s: {last_error}")

    def restart(self) -> EtcdServer:
        """Start again after ``stop``, on the same ports and data dir (what was written survives)."""
        assert self.proc is None and self.client_port
        if not self._launch():
            raise RuntimeError("etcd did not come back: " + self._log_path().read_text(errors="replace")[-2000:])
        return self

    def _log_path(self) -> pathlib.Path:
        return self.workdir / f"etcd-{self.client_port}.log"

    def _launch(self) -> bool:
        data = self.workdir / f"etcd-data-{self.client_port}"
        with open(self._log_path(), "ab") as log:
            self.proc = subprocess.Popen([
                self.binary, "--name", "test", "--data-dir", str(data),
                "--listen-client-urls", f"http://127.0.0.1:{self.client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
                "--logger", "zap", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        return self._wait_healthy()

    def _wait_healthy(self) -> bool:
        end = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)  # polling a condition with a deadline
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
