"""The lighthouse's HTTP side port: ``/status`` (JSON), ``/metrics`` (Prometheus), ``/`` (a page for people).

Runs a stdlib threading HTTP server; each request asks for a consistent snapshot (``snapshot``, which the
lighthouse answers on its event loop) of the status view (``lighthouse.server.status``).
With TLS configured it serves HTTPS (client certificates required with a client CA); with a job token every
path but ``/healthz`` (for probes; it says only "ok") needs ``Authorization: Bearer <token>`` (or HTTP Basic with
the token as password, for browsers), where a read-only credential (``fthsdp secrets``: ``reader.credential``, for
Prometheus) or a replica's credential does as well as the job secret: every path here only reads.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from lighthouse import page
from lighthouse.capped_http import CappedHTTPServer
from lighthouse.metrics import LighthouseMetrics
from lighthouse.security import BEARER, ServerSecurity, principal_of

REQUEST_TIMEOUT_S = 10.0
"""A connection that sends nothing (or stalls its TLS handshake) this long is dropped."""
MAX_CONNECTIONS = 64
"""Connections served at once (a thread each); one more is closed at once, so that idle or slow connections cost
at most this many threads for ``REQUEST_TIMEOUT_S`` each."""
log = logging.getLogger("fthsdp.lighthouse.http")


def authorized(token: str | None, header: str | None) -> bool:
    """Whether an ``Authorization`` header carries the job secret ``token`` or a credential derived from it (every
    kind may read: a reader credential is made for this port), as Bearer, or Basic with it as the password."""
    if token is None:
        return True
    if not header:
        return False
    if header.startswith("Basic "):
        try:
            _, _, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return principal_of(token, password) is not None
    return header.startswith(BEARER) and principal_of(token, header) is not None


class StatusHTTPServer:
    """Serves on ``address`` until ``close``; ``snapshot()`` gives the status JSON (raising when it cannot)."""

    def __init__(self, address: str, security: ServerSecurity, metrics: LighthouseMetrics,
                 snapshot: Callable[[], dict[str, Any]], max_connections: int = MAX_CONNECTIONS) -> None:
        host, port = address.rsplit(":", 1)
        sec = security

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no per-request lines
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":  # for probes: no token, and it tells nothing but that we serve
                    self._send(200, b'{"ok": true}', "application/json")
                    return
                if not authorized(sec.token, self.headers.get("Authorization")):
                    metrics.rpc_error("http", "UNAUTHENTICATED")
                    body = json.dumps({"error": "unauthenticated: send 'Authorization: Bearer <job token>'"
                                       if self.headers.get("Authorization") is None else
                                       "unauthenticated: wrong job token or credential"}).encode()
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="fthsdp lighthouse"')
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if path == "/metrics":
                    self._send(200, metrics.render(), "text/plain; version=0.0.4")
                    return
                if path not in ("/", "/status"):
                    self._send(404, b'{"error": "not found"}', "application/json")
                    return
                try:
                    status = snapshot()
                except Exception as e:
                    self._send(503, json.dumps({"error": f"no snapshot: {e!r}"}).encode(), "application/json")
                    return
                if path == "/status":
                    self._send(200, json.dumps(status).encode(), "application/json")
                else:
                    self._send(200, page.render_page(status).encode(), "text/html; charset=utf-8")

        self._httpd = CappedHTTPServer((host.strip("[]"), int(port)), Handler, max_connections=max_connections)
        ctx = sec.ssl_context()
        if ctx is not None:
            # The handshake happens on the request's own thread (first read), not in accept(): a client that
            # stalls it cannot block the server.
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True,
                                                 do_handshake_on_connect=False)
        self.port = self._httpd.server_address[1]
        # A short poll interval: close() (shutdown) waits up to one interval, on the lighthouse's event loop.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="lighthouse-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
