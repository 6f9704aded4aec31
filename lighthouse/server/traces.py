"""The latest trace of the job that someone published (``fthsdp trace --publish``: ``PUT /trace`` on the HTTP side
port), kept in this lighthouse's memory so that its page can link it (``GET /trace.json``). One trace, the newest
replacing the one before; at most ``MAX_TRACE_BYTES``; a body that is not a Chrome trace-event document (a JSON
object with a ``traceEvents`` list) is refused and changes nothing. Not replicated: each lighthouse of an HA set
keeps what was published to it (``fthsdp trace --publish`` sends it to every address it is given)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

MAX_TRACE_BYTES = 32 * 1024 * 1024
"""The largest trace kept (a 3 x 2 demo's is about 1 MB; a long ``--follow`` of a large job is bigger)."""


class BadTrace(ValueError):
    """A published body that is not a trace this lighthouse keeps (the message says why)."""


@dataclass(frozen=True)
class TraceMeta:
    """What ``/status`` and the page say of the latest trace."""

    published_unix: float
    bytes: int
    events: int
    job: str

    def to_json(self) -> dict[str, Any]:
        return {"published_unix": self.published_unix, "bytes": self.bytes, "events": self.events, "job": self.job,
                "url": "/trace.json"}


def check(body: bytes, job: str) -> TraceMeta:
    """The meta of ``body`` as a trace of job ``job``; ``BadTrace`` when it is too large, not JSON, not a Chrome
    trace-event document, or of another job (its ``otherData.job``, when it names one)."""
    if len(body) > MAX_TRACE_BYTES:
        raise BadTrace(f"a trace of {len(body)} bytes is over the {MAX_TRACE_BYTES}-byte limit")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadTrace(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise BadTrace("not a Chrome trace-event document: a JSON object with a 'traceEvents' list")
    other = doc.get("otherData")
    named = other.get("job") if isinstance(other, dict) else None
    if named is not None and named != job:
        raise BadTrace(f"a trace of job {named!r}, not of this lighthouse's job {job!r}")
    return TraceMeta(time.time(), len(body), len(doc["traceEvents"]), job)


class LatestTrace:
    """The newest published trace (thread-safe: the HTTP server serves each request on a thread of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._meta: TraceMeta | None = None

    def publish(self, body: bytes, job: str) -> TraceMeta:
        """Keep ``body`` as the latest trace (``check``'s ``BadTrace`` otherwise, and nothing changes)."""
        meta = check(body, job)
        with self._lock:
            self._body, self._meta = body, meta
        return meta

    def latest(self) -> tuple[bytes, TraceMeta] | None:
        with self._lock:
            return None if self._body is None or self._meta is None else (self._body, self._meta)

    def meta(self) -> TraceMeta | None:
        with self._lock:
            return self._meta
