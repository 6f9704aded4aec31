"""A TCP proxy on loopback for tests: what the client sends and what the server answers each pass through a hook
(per connection, in order) that may record or rewrite the bytes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

Hook = Callable[[int, bytes], bytes]
"""``hook(offset, data) -> data``: ``data`` starts at byte ``offset`` of its direction of one connection."""


def _same(offset: int, data: bytes) -> bytes:
    return data


class Proxy:
    """Forwards connections to ``upstream``; ``up`` sees the client's bytes, ``down`` the server's."""

    def __init__(self, upstream: str, up: Hook = _same, down: Hook = _same) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.up, self.down = (host, int(port)), up, down
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            server = socket.create_connection(self.upstream, timeout=10)
            threading.Thread(target=self._pump, args=(client, server, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, hook: Hook) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                out = hook(seen, data)
                seen += len(data)
                dst.sendall(out)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
