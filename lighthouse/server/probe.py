"""Is a replica whose session closed gone, or the leader a follower lighthouse follows? One TCP connection tells.

A session that closes from the replica's end is a process that died (its kernel closed the connection) or one that
only lost its connection to the lighthouse (a network blip, a client moving to another lighthouse). A peer's
failure report tells the two apart today (``lighthouse.membership``), but it comes only when a peer's exchange
fails: a whole step after a death at the start of one. The replica's catch-up endpoint is served by the same
process (its rank 0, which holds the session): a connection to it that is *refused* (the host answered, nothing
listens) says the process is gone, at once. Anything else (it connects, the host does not answer in time, no
route) proves nothing, and the death waits for a report or for silence, as before.
"""

from __future__ import annotations

import asyncio
import socket


def split(address: str) -> tuple[str, int] | None:
    """``host:port`` (a bracketed IPv6 host too), or None when it is not one."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


KNOCK_TIMEOUT_S = 0.2
"""How long a follower's knock on the leader's port waits (``knock``): loopback and LAN answer in microseconds."""


def knock(address: str, timeout_s: float = KNOCK_TIMEOUT_S) -> bool | None:
    """One blocking TCP connection to ``address``: True refused (nothing listens: the process is gone), False
    answered, None no evidence (a timeout, no route, not an address). A follower lighthouse's test of its leader
    (``lighthouse.stores.election``)."""
    target = split(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


async def refused(address: str, timeout_s: float) -> bool:
    """True only when a TCP connection to ``address`` is refused within ``timeout_s`` (``knock``, off the loop)."""
    return await asyncio.to_thread(knock, address, timeout_s) is True
