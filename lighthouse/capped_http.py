"""A threading HTTP server that serves at most ``max_connections`` connections at once (a thread each): one more is
closed at once instead of costing a thread, so idle or slow clients cost at most that many threads for the
handler's timeout each. The lighthouse's HTTP side port and every rank's metrics exporter serve with it."""

from __future__ import annotations

import logging
import threading
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger("fthsdp.http")


class CappedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args: Any, max_connections: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        """Connections closed because ``max_connections`` were being served."""

    @property
    def free(self) -> int:
        """Places left for connections now."""
        return self._slots._value  # (BoundedSemaphore's count)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            log.warning("http %s: connections at their limit: closing the one from %s", self.server_address,
                        client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread took it: give its place back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed TLS handshake or a dropped connection is the client's problem: log it, no traceback."""
        log.debug("http connection from %s failed", client_address, exc_info=True)
