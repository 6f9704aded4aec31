"""The local cluster under chaos: a ``Cluster`` (``fthsdp.launch.cluster``) whose replica groups each read a fault
file (``FTHSDP_FAULT_FILE``, armed while they run), and, with HA, several lighthouses on a loopback etcd."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fthsdp.launch.cluster import Cluster, streams_opened
from fthsdp.launch.config import ClusterConfig
from fthsdp.launch.lighthouse_process import start_lighthouse_process
from fthsdp.launch.procutil import stop_process, write_atomic
from fthsdp.testing.etcd import EtcdCluster


@dataclass
class LighthouseProc:
    """One lighthouse of the HA set: its process and, once started, its addresses (a restart keeps them)."""

    index: int
    workdir: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    grpc: str = ""
    http: str = ""


class ChaosCluster(Cluster):
    """A ``Cluster`` whose replicas get a fault file each, and, with ``etcd``, several lighthouses on it (the
    replicas get them all in ``FTHSDP_LIGHTHOUSE``)."""

    def __init__(self, config: ClusterConfig, workdir: pathlib.Path, on_tick: Callable[[Cluster], None],
                 etcd: EtcdCluster | None = None, lighthouses: int = 3, election_ttl_s: int = 2) -> None:
        self.fault_files = {i: workdir / f"replica{i}.fault" for i in range(config.replicas)}
        env = {i: {**config.env.get(i, {}), "FTHSDP_FAULT_FILE": str(self.fault_files[i])}
               for i in range(config.replicas)}
        super().__init__(dataclasses.replace(config, env=env), workdir, on_tick=on_tick)
        self.etcd = etcd
        self.election_ttl_s = election_ttl_s
        self.lighthouses = [LighthouseProc(i, workdir / f"lighthouse{i}") for i in range(lighthouses if etcd else 0)]
        self.prefix = "chaos-" + uuid.uuid4().hex[:10]

    # lighthouses ----------------------------------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        if self.etcd is None:
            super().start_lighthouse()
            return
        for lh in self.lighthouses:
            lh.workdir.mkdir(parents=True, exist_ok=True)
            self.start_one_lighthouse(lh)
        self.addr = ",".join(lh.grpc for lh in self.lighthouses)
        self.http = self.lighthouses[0].http

    def start_one_lighthouse(self, lh: LighthouseProc) -> None:
        """Start (or restart, on the same ports) one lighthouse of the HA set."""
        assert self.etcd is not None
        args = [*self.lighthouse_args(), "--store", self.etcd.url(self.prefix),
                "--election-ttl", str(self.election_ttl_s)]
        if lh.grpc:
            args += ["--bind", lh.grpc, "--http", lh.http]  # parsed after the launcher's port-0 defaults
            (lh.workdir / "lighthouse.ports").unlink(missing_ok=True)
            log_path = lh.workdir / "lighthouse.log"
            if log_path.exists():  # the restart writes a new log: keep the killed one's
                os.replace(log_path, lh.workdir / f"lighthouse.log.{time.time():.0f}")
        lh.proc, lh.grpc, lh.http = start_lighthouse_process(args, lh.workdir)

    def stop_lighthouse(self) -> None:
        if self.etcd is None:
            super().stop_lighthouse()
            return
        live = [lh.proc for lh in self._live() if lh.proc is not None]
        for proc in live:  # all at once: each one's graceful stop gives its lease back and waits on etcd
            proc.send_signal(signal.SIGTERM)
        for proc in live:
            stop_process(proc)

    def _live(self) -> list[LighthouseProc]:
        return [lh for lh in self.lighthouses if lh.proc is not None and lh.proc.poll() is None]

    def statuses(self) -> list[dict[str, Any]]:
        """The status of every lighthouse that answers (one, without HA)."""
        answers = (_status_or_none(http) for http in ([lh.http for lh in self._live()] if self.etcd else [self.http]))
        return [s for s in answers if s is not None]

    def status(self) -> dict[str, Any]:
        """The leader's status (the launcher reads the epoch history from it at the end)."""
        if self.etcd is None:
            return super().status()
        end = time.monotonic() + 30
        while True:
            leaders = [s for s in self.statuses() if s.get("leader")]
            if leaders:
                return leaders[0]
            if time.monotonic() > end:
                raise RuntimeError("no lighthouse leads (the end-of-run status cannot be read)")
            time.sleep(0.2)  # polling a condition with a deadline

    def lighthouse_streams(self) -> dict[str, int]:
        """Streams opened by kind, summed over the lighthouses alive at the end (one that was killed took its
        counts with it: the chaos runner may kill the leader just before the end)."""
        if self.etcd is None:
            return super().lighthouse_streams()
        total: dict[str, int] = {}
        for lh in self._live():
            try:
                counts = streams_opened(lh.http)
            except OSError:  # URLError included: it is on its way down, or not up again yet
                continue
            for kind, n in counts.items():
                total[kind] = total.get(kind, 0) + n
        return total

    def leader(self) -> LighthouseProc | None:
        """The lighthouse that answers as the leader, if one does."""
        for lh in self._live():
            status = _status_or_none(lh.http)
            if status is not None and status.get("leader"):
                return lh
        return None

    # fault files ----------------------------------------------------------------------------------------------

    def arm(self, replica: int, step: int, phase: str) -> None:
        """Arm a kill of ``replica`` at ``phase`` of ``step`` (its rank 0 reads the file at each phase)."""
        write_atomic(self.fault_files[replica], f"{step}:{phase}")  # a new inode: noticed at the next phase

    def disarm(self, replica: int) -> None:
        """No kill armed for ``replica`` (an absent file)."""
        self.fault_files[replica].unlink(missing_ok=True)


def _status_or_none(http: str) -> dict[str, Any] | None:
    """A lighthouse's ``/status``, or None when it does not answer (down, restarting)."""
    try:
        with urllib.request.urlopen(f"http://{http}/status", timeout=2) as r:
            got = json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None
