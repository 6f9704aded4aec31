"""The lighthouse's HTTP side port serves at most ``max_connections`` connections at once (issue 41): one more is
closed at once instead of costing a thread, and the port serves again as soon as the idle ones are gone."""

from __future__ import annotations

import json
import socket

import pytest

from lighthouse.metrics import LighthouseMetrics
from lighthouse.security import ServerSecurity
from lighthouse.server.http import StatusHTTPServer
from tests.helpers.lighthouse import https_get, wait_until

pytestmark = pytest.mark.timeout(60)


def test_connections_past_the_cap_are_closed_at_once_and_the_port_recovers() -> None:
    srv = StatusHTTPServer("127.0.0.1:0", ServerSecurity(), LighthouseMetrics(), lambda: {"ok": 1}, max_connections=4)
    addr = f"127.0.0.1:{srv.port}"
    idle: list[socket.socket] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
        wait_until(lambda: srv._httpd.free == 0, 10, what="the 4 idle connections taken in")
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=2)  # uncapped, it would wait 10 s
        assert extra.recv(1) == b""  # closed at once, no thread started for it
        extra.close()
        assert srv._httpd.refused == 1
        for s in idle:
            s.close()
        wait_until(lambda: srv._httpd.free == 4, 10, what="the places given back")
        code, body, _ = https_get(addr, "/healthz")
        assert code == 200 and json.loads(body) == {"ok": True}
    finally:
        for s in idle:
            s.close()
        srv.close()
