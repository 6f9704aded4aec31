"""The real command line of the lighthouse: ``fthsdp lighthouse`` serves, answers ``fthsdp status`` and stops
cleanly on SIGTERM; ``fthsdp status`` reports an unreachable lighthouse. (The server itself, in process, is
tested in tests/unit/test_lighthouse_service.py.)"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time

import grpc

from fthsdp.launch.procutil import stop_process, wait_for_file
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, heartbeat, register, status

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_cli_lighthouse_serves_status_and_stops_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    port_file = tmp_path / "ports"
    log_path = tmp_path / "lighthouse.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fthsdp", "lighthouse", "--bind", "127.0.0.1:0",
                                 "--http", "127.0.0.1:0", "--port-file", str(port_file), "--heartbeat-timeout", "60",
                                 "--job", "default", "--job", "other"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    # The replicas below heartbeat by hand, once, and each `fthsdp status` is a Python start-up: on a busy machine
    # (the training lane beside this one) two of them took more than 5 s, and the silent replicas were declared dead.
    try:
        ports = dict(kv.split("=", 1) for kv in wait_for_file(port_file, timeout=60, proc=proc).split())
        assert int(ports["grpc"]) > 0 and int(ports["http"]) > 0
        # Hosted by the lanes' members, with the lighthouse's authenticated gRPC service behind them (no TCPStore).
        assert ports["rendezvous"] == "members:"
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as ch:
            stub = pb_grpc.LighthouseStub(ch)
            r = register(stub, "cli-replica")
            assert r.epoch.number == 1 and r.role == pb.ROLE_ACTIVE
            assert r.epoch.rendezvous == "members+lighthouse:default/epoch1"  # the first epoch: hosts announced
            assert status(stub, "other").epoch.number == 0
            # An open watch stream must not hold up the shutdown.
            watch = stub.Watch(pb.WatchRequest(job_id=JOB), timeout=30)
            assert next(watch).number == 1

            def fthsdp_status() -> str:
                out = subprocess.run([sys.executable, "-m", "fthsdp", "status", "--http",
                                      f"127.0.0.1:{ports['http']}"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=60)
                assert out.returncode == 0, out.stderr
                return out.stdout

            text = fthsdp_status()
            assert "REPLICA" in text and "HB AGE" in text and "COMPUTE" in text
            assert re.search(r"^cli-replica\s+active\s+yes\s+0\s+\d+\.\d\d\s+-\s+-  -$", text, re.M), text
            assert "state: not compared yet" in text and "stragglers: none" in text
            # The replicas' state digests and whether they agree (heartbeats carry them).
            other = register(stub, "cli-replica-2")
            heartbeat(stub, "cli-replica", r.incarnation, step=5, digest=(4, "00ff00ff00ff00ff"), pace=(4, 0.25, 0.0))
            heartbeat(stub, "cli-replica-2", other.incarnation, step=5, digest=(4, "00ff00ff00ff00ff"))
            text = fthsdp_status()
            assert re.search(r"^cli-replica\s+active\s+yes\s+5\s+\d+\.\d\d\s+0\.250\s+0\.000  00ff00ff00ff00ff \(4\)$",
                             text, re.M), text
            assert "state: agree at step 4 (2 replicas)" in text

            started = time.monotonic()
            code = stop_process(proc, timeout=15)
            assert code == 0, log_path.read_text()
            assert time.monotonic() - started < 10
            try:
                rest = list(watch)  # the stream ended with the server: cleanly, or cut off
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            else:
                assert rest == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "lighthouse stopped" in text and "Traceback" not in text


def test_cli_status_reports_an_unreachable_lighthouse() -> None:
    import socket

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "fthsdp", "status", "--http", f"127.0.0.1:{port}", "--timeout", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot reach" in out.stderr
