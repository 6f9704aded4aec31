"""The lighthouse's HTTP side port: ``/status`` (JSON), ``/metrics`` (Prometheus), ``/`` (a page for people), and
the latest published trace of the job (``PUT /trace`` by ``fthsdp trace --publish``, ``GET /trace.json``; the page
links it: ``lighthouse.server.traces``).

Runs a stdlib threading HTTP server; each request asks for a consistent snapshot (``snapshot``, which the
lighthouse answers on its event loop) of the status view (``lighthouse.server.status``).
With TLS configured it serves HTTPS (client certificates required with a client CA); with a job token every
path but ``/healthz`` (for probes; it says only "ok") needs ``Authorization: Bearer <token>`` (or HTTP Basic with
the token as password, for browsers), where a read-only credential (``fthsdp secrets``: ``reader.credential``, for
Prometheus) or a replica's credential does as well as the job secret for reading. Publishing a trace (the only
write) takes the job secret or a replica's credential, never the read-only one.
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
from lighthouse.credentials import JOB_PRINCIPAL, Principal, Role
from lighthouse.metrics import LighthouseMetrics
from lighthouse.security import BEARER, ServerSecurity, principal_of
from lighthouse.server.traces import MAX_TRACE_BYTES, BadTrace, LatestTrace

REQUEST_TIMEOUT_S = 10.0
"""A connection that sends nothing (or stalls its TLS handshake) this long is dropped."""
MAX_CONNECTIONS = 64
"""Connections served at once (a thread each); one more is closed at once, so that idle or slow connections cost
at most this many threads for ``REQUEST_TIMEOUT_S`` each."""
log = logging.getLogger("fthsdp.lighthouse.http")


def caller(token: str | None, header: str | None) -> Principal | None:
    """Who an ``Authorization`` header says the caller is: the job secret ``token`` or a credential derived from it,
    as Bearer, or Basic with it as the password; None: refused."""
    if token is None:
        return JOB_PRINCIPAL
    if not header:
        return None
    if header.startswith("Basic "):
        try:
            _, _, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return principal_of(token, password)
    return principal_of(token, header) if header.startswith(BEARER) else None


class StatusHTTPServer:
    """Serves on ``address`` until ``close``; ``snapshot()`` gives the status JSON (raising when it cannot)."""

    def __init__(self, address: str, security: ServerSecurity, metrics: LighthouseMetrics,
                 snapshot: Callable[[], dict[str, Any]], max_connections: int = MAX_CONNECTIONS) -> None:
        host, port = address.rsplit(":", 1)
        sec = security
        self.trace = trace = LatestTrace()

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

            def _error(self, code: int, message: str) -> None:
                self._send(code, json.dumps({"error": message}).encode(), "application/json")

            def _caller(self) -> Principal | None:
                """The caller, or None after answering 401."""
                if (who := caller(sec.token, self.headers.get("Authorization"))) is not None:
                    return who
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
                return None

            def do_PUT(self) -> None:
                """``PUT /trace``: keep the body as the job's latest trace (``traces.LatestTrace.publish``)."""
                if self.path.split("?", 1)[0] != "/trace":
                    self._error(404, "not found")
                    return
                if (who := self._caller()) is None:
                    return
                if who.role is Role.READER:
                    self._error(403, f"{who} cannot publish a trace: use the job secret or a replica's credential")
                    return
                try:
                    size = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._error(411, "send the trace with a Content-Length")
                    return
                if not 0 <= size <= MAX_TRACE_BYTES:
                    self.close_connection = True  # its body is not read
                    self._error(413, f"a trace of {size} bytes is over the {MAX_TRACE_BYTES}-byte limit")
                    return
                body = self.rfile.read(size)
                try:
                    job = str(snapshot()["job"])
                    meta = trace.publish(body, job)
                except BadTrace as e:
                    self._error(400, f"not kept: {e}")
                    return
                except Exception as e:
                    self._error(503, f"no snapshot: {e!r}")
                    return
                self._send(200, json.dumps(meta.to_json()).encode(), "application/json")

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":  # for probes: no token, and it tells nothing but that we serve
                    self._send(200, b'{"ok": true}', "application/json")
                    return
                if self._caller() is None:
                    return
                if path == "/metrics":
                    self._send(200, metrics.render(), "text/plain; version=0.0.4")
                    return
                if path == "/trace.json":
                    if (latest := trace.latest()) is None:
                        self._error(404, "no trace published yet: fthsdp trace --publish")
                    else:
                        self._send(200, latest[0], "application/json")
                    return
                if path not in ("/", "/status"):
                    self._error(404, "not found")
                    return
                try:
                    status = snapshot()
                except Exception as e:
                    self._error(503, f"no snapshot: {e!r}")
                    return
                status["trace"] = None if (meta := trace.meta()) is None else meta.to_json()
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
