"""Who may use a member's lane store (``ftar.lane_store``), as pure functions: every request carries a MAC of its own
bytes under the key the job's replicas share (the catch-up key: ``lighthouse.credentials.catchup_key``).

The MAC is ``HMAC-SHA256(key, context || method || nonce || body)`` (NUL-separated), the nonce a send time and
random bytes. The key never crosses the wire; a request cannot be altered, moved to another method or replayed:
the server refuses a nonce it has seen, and one whose time is more than ``SKEW_S`` off its own clock (so it need
only remember the nonces of that window, at most ``capacity`` of them). Without a key (a job without a token) there
is nothing to sign, and the store serves loopback only (``serving_allowed``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

from lighthouse.security import is_loopback

CONTEXT = b"fthsdp-lane-store-v1"
"""Binds a MAC to this protocol (no other use of the key yields the same one)."""
NONCE_HEADER = "fthsdp-store-nonce"
MAC_HEADER = "fthsdp-store-mac"
SKEW_S = 60.0
"""How far a request's send time may be from the server's clock."""
CAPACITY = 200_000
"""The most nonces a server remembers (a window's worth at well over a thousand requests a second)."""


def mac(key: str, method: str, nonce: str, body: bytes) -> str:
    """The hex MAC of a request."""
    return hmac.new(key.encode(), b"\0".join([CONTEXT, method.encode(), nonce.encode(), body]),
                    hashlib.sha256).hexdigest()


def sign(key: str, method: str, body: bytes, now: float) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates ``body`` sent to ``method`` at ``now`` (none without a key)."""
    if not key:
        return ()
    nonce = f"{now:.3f}:{secrets.token_hex(16)}"
    return (NONCE_HEADER, nonce), (MAC_HEADER, mac(key, method, nonce, body))


class Verifier:
    """A server's check of the requests' MACs, with the nonces it has seen in the last ``skew_s``."""

    def __init__(self, key: str, skew_s: float = SKEW_S, capacity: int = CAPACITY) -> None:
        self.key = key
        self.skew_s = skew_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()
        """nonce -> its send time, oldest received first."""

    def refusal(self, method: str, body: bytes, metadata: dict[str, str], now: float) -> str | None:
        """Why the request is refused (``None``: admitted, and its nonce is remembered)."""
        if not self.key:
            return None
        nonce, got = metadata.get(NONCE_HEADER, ""), metadata.get(MAC_HEADER, "")
        if not nonce or not got:
            return "unauthenticated: no request MAC (the job's catch-up key signs every request)"
        try:
            sent = float(nonce.split(":", 1)[0])
        except ValueError:
            return "malformed nonce"
        if abs(now - sent) > self.skew_s:
            return f"request sent {now - sent:+.0f} s from this clock (more than {self.skew_s:.0f} s)"
        if not hmac.compare_digest(got.encode(), mac(self.key, method, nonce, body).encode()):
            return "bad request MAC (another job's key, or an altered request)"
        while self._seen and next(iter(self._seen.values())) < now - 2 * self.skew_s:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "replayed request"
        if len(self._seen) >= self.capacity:
            return "too many requests in the replay window"
        self._seen[nonce] = sent
        return None


def serving_allowed(host: str, key: str) -> bool:
    """A lane store may listen on ``host``: anywhere with a key, only on loopback without one."""
    return bool(key) or is_loopback(host)
