"""A catch-up server's answer to a timeline read (``TRACE``, ``fthsdp.catchup.wire``): the rank's step timeline
(``fthsdp.runtime.timeline``) to a reader that proves the job token for the session's nonce, nothing registered or
copied for it (``fthsdp trace``)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from fthsdp.catchup import auth, wire
from fthsdp.catchup.wire import Kind, TraceRequest

Reader = Callable[[int], dict[str, Any]]
"""A rank's timeline after a sequence number (``fthsdp.runtime.timeline.Timeline.read``)."""


def refusal(request: TraceRequest, nonce: str, token: str, job: str, read: Reader | None) -> tuple[str, str] | None:
    """Why a timeline read is refused (code, message): ``unauthenticated``, ``wrong_job``, ``unavailable`` (no
    timeline kept); None: answer it."""
    if not auth.verify_trace(token, nonce, request):
        return "unauthenticated", "wrong or missing proof of the job token"
    if request.job != job:
        return "wrong_job", f"this replica serves job {job!r}, not {request.job[:80]!r}"
    if read is None:
        return "unavailable", "this rank keeps no timeline (FTHSDP_TIMELINE=0)"
    return None


def answer(conn: socket.socket, since: int, read: Reader, identity: dict[str, Any]) -> None:
    """Send the events after ``since`` (``read``'s), with ``identity`` (the rank, its replica and incarnation, every
    rank's address: a reader asks the others there): the newest events that fit one control frame."""
    doc = read(since)
    while True:
        try:
            wire.send_control(conn, Kind.TIMELINE, {**identity, "timeline": doc})
            return
        except wire.ProtocolError:  # over the frame's limit: the newer half
            if not doc["events"]:
                raise
            doc = {**doc, "events": doc["events"][len(doc["events"]) // 2:]}
