"""The catch-up wire format: framed messages over TCP.

Every frame starts with ``magic, version, kind, payload length``. Control frames carry one small JSON object
with a fixed schema (checked field by field on receipt); data frames carry a fixed binary chunk header
(entry, offset, length, CRC-32C) followed by raw tensor bytes. Nothing received is unpickled or evaluated.

A session (joiner rank s to source rank s)::

    joiner                                  source
                                          <-  CHALLENGE {nonce}
    HELLO {job, replica, incarnation, rank, step, proof, nonce}  ->   (``fthsdp.catchup.auth``; never the token)
                                          <-  REDIRECT {addr}        (asked the wrong rank)
                                          <-  QUEUED {step}          (registered: step S will be served)
                                          <-  MANIFEST {step, entries, chunk_bytes, proof}   (once the snapshot
                                                                     exists; proof: the source's, of the token)
    GET {ranges: [[entry, offset, length]]} ->
                                          <-  DATA ... DATA END
    BYE                                     ->
    (any error)                           <-  ERROR {code, message}

A timeline read (``fthsdp trace``, any rank, nothing registered or copied)::

    reader                                  source
                                          <-  CHALLENGE {nonce}
    TRACE {job, since, proof}               ->   (``fthsdp.catchup.auth.trace_proof``)
                                          <-  TIMELINE {replica, incarnation, rank, directory, timeline}
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from crc32c import crc32c

checksum: Callable[[bytes | bytearray | memoryview], int] = crc32c
"""CRC-32C: hardware-accelerated (~3x zlib's CRC-32), and off the GIL."""

MAGIC = b"FTCU"
VERSION = 4
"""2: the token is proven by HMAC over a nonce (``CHALLENGE``), never sent. 3: ``QUEUED`` before a manifest that
is not ready yet."""
FRAME = struct.Struct("!4sBBI")
"""magic, version, kind, payload length."""
CHUNK = struct.Struct("!IQII")
"""entry index, byte offset, byte length, CRC-32C of the bytes."""
MAX_CONTROL = 1 << 20
"""Largest control payload accepted (a manifest of tens of thousands of tensors fits)."""
MAX_CHUNK = 64 << 20
MIN_CHUNK = 64 << 10
"""A manifest's chunk size is at least this: the joiner books each chunk, so a tiny one would cost it a record per
byte."""
DEFAULT_CHUNK = 4 << 20
MAX_RANGES = 1 << 16


class Kind(IntEnum):
    HELLO = 1
    REDIRECT = 2
    MANIFEST = 3
    GET = 4
    DATA = 5
    END = 6
    BYE = 7
    ERROR = 8
    CHALLENGE = 9
    QUEUED = 10
    TRACE = 11
    TIMELINE = 12


class CatchupError(RuntimeError):
    """Base of the catch-up errors."""


class ProtocolError(CatchupError):
    """A malformed, oversized or unexpected message: the connection is closed."""


class Refused(CatchupError):
    """The peer answered with an ERROR frame (``code``: bad_request, unauthenticated, wrong_job, not_member,
    not_joining, stale_incarnation, not_active, too_late, busy, closed, timeout, unavailable)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SourceLost(CatchupError):
    """The connection to a source broke (it died, or the network did)."""


class FetchFailed(CatchupError):
    """No source could supply the snapshot."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a snapshot: its name, dtype (``torch.float32`` style), shape and size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def doc(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nbytes]


@dataclass(frozen=True)
class Hello:
    """A joiner's request: who it is (replica, incarnation), what it wants (rank, step), its ``proof`` of the
    job token for this session's nonce, and its own ``nonce`` for the source to answer (``fthsdp.catchup.auth``)."""

    job: str
    replica: str
    incarnation: str
    rank: int
    step: int
    proof: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class TraceRequest:
    """A timeline reader's request: the job, the events it wants (after sequence number ``since``) and its
    ``proof`` of the job token for this session's nonce (``fthsdp.catchup.auth.trace_proof``)."""

    job: str
    since: int = 0
    proof: str = ""


@dataclass(frozen=True)
class Manifest:
    step: int
    entries: tuple[Entry, ...]
    chunk_bytes: int
    proof: str = ""
    """The source's answer to the joiner's nonce (``fthsdp.catchup.auth.source_proof``)."""


# --- framing ------------------------------------------------------------------------------------------------------

def split_address(host_port: str) -> tuple[str, int]:
    """``host:port`` (brackets around an IPv6 host allowed) as (host, port); ``ValueError`` otherwise."""
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {host_port!r} (expected host:port)")
    return host.strip("[]"), int(port)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as e:
            raise SourceLost("timed out waiting for the peer") from e
        except OSError as e:
            raise SourceLost(f"connection broken: {e}") from e
        if n == 0:
            raise SourceLost("connection closed by the peer")
        got += n


def send_control(sock: socket.socket, kind: Kind, obj: dict[str, Any]) -> None:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if len(payload) > MAX_CONTROL:
        raise ProtocolError(f"{kind.name} payload of {len(payload)} bytes exceeds {MAX_CONTROL}")
    try:
        sock.sendall(FRAME.pack(MAGIC, VERSION, kind, len(payload)) + payload)
    except OSError as e:
        raise SourceLost(f"connection broken: {e}") from e


def send_data(sock: socket.socket, entry: int, offset: int, view: memoryview, crc: int | None = None) -> None:
    """One DATA frame: the chunk header, then the bytes straight from ``view`` (no copy)."""
    head = FRAME.pack(MAGIC, VERSION, Kind.DATA, CHUNK.size + len(view)) + \
        CHUNK.pack(entry, offset, len(view), checksum(view) if crc is None else crc)
    try:
        sock.sendall(head)
        sock.sendall(view)
    except OSError as e:
        raise SourceLost(f"connection broken: {e}") from e


def recv_header(sock: socket.socket) -> tuple[Kind, int]:
    magic, version, kind, length = FRAME.unpack(recv_exact(sock, FRAME.size))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a catch-up peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    limit = MAX_CHUNK + CHUNK.size if k == Kind.DATA else MAX_CONTROL
    if length > limit:
        raise ProtocolError(f"{k.name} frame of {length} bytes exceeds {limit}")
    return k, length


def recv_control(sock: socket.socket, expect: tuple[Kind, ...]) -> tuple[Kind, dict[str, Any]]:
    """Read one control frame of a kind in ``expect`` (an ERROR frame raises ``Refused``)."""
    kind, length = recv_header(sock)
    if kind == Kind.DATA:
        raise ProtocolError("unexpected DATA frame")
    payload = recv_exact(sock, length)
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{kind.name} payload is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{kind.name} payload must be a JSON object")
    if kind == Kind.ERROR:
        raise Refused(str_field(obj, "code", 64), str_field(obj, "message", 4096))
    if kind not in expect:
        raise ProtocolError(f"unexpected {kind.name} (expected {', '.join(k.name for k in expect)})")
    return kind, obj


def linger_close(conn: socket.socket) -> None:
    """Close so that an ERROR frame just sent reaches the peer: closing with unread input would reset the
    connection and drop it. Reads (and discards) at most 1 MiB for at most half a second."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.5)
        for _ in range(16):
            if not conn.recv(65536):
                break
    except OSError:
        pass
    conn.close()


def send_error(sock: socket.socket, code: str, message: str) -> None:
    with contextlib.suppress(CatchupError):  # the peer is gone; nothing to tell
        send_control(sock, Kind.ERROR, {"code": code, "message": message[:4096]})


# --- schemas ------------------------------------------------------------------------------------------------------

def str_field(obj: dict[str, Any], key: str, limit: int) -> str:
    """A control frame's string field ``key``, checked: at most ``limit`` characters."""
    v = obj.get(key)
    if not isinstance(v, str) or len(v) > limit:
        raise ProtocolError(f"field {key!r} must be a string of at most {limit} characters")
    return v


def _int(obj: Any, key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    v = obj.get(key) if isinstance(obj, dict) else obj
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}]")
    return v


def hello_doc(h: Hello) -> dict[str, Any]:
    return {"job": h.job, "replica": h.replica, "incarnation": h.incarnation, "rank": h.rank, "step": h.step,
            "proof": h.proof, "nonce": h.nonce}


def parse_hello(obj: dict[str, Any]) -> Hello:
    return Hello(str_field(obj, "job", 256), str_field(obj, "replica", 256), str_field(obj, "incarnation", 256),
                 _int(obj, "rank", 0, 1 << 20), _int(obj, "step"), str_field(obj, "proof", 128),
                 str_field(obj, "nonce", 128))


def trace_doc(t: TraceRequest) -> dict[str, Any]:
    return {"job": t.job, "since": t.since, "proof": t.proof}


def parse_trace(obj: dict[str, Any]) -> TraceRequest:
    return TraceRequest(str_field(obj, "job", 256), _int(obj, "since"), str_field(obj, "proof", 128))


def parse_queued(obj: dict[str, Any]) -> int:
    """The step a ``QUEUED`` frame registered."""
    return _int(obj, "step")


def parse_challenge(obj: dict[str, Any]) -> str:
    nonce = str_field(obj, "nonce", 128)
    if len(nonce) < 32:
        raise ProtocolError("the challenge's nonce is too short")
    return nonce


def manifest_doc(m: Manifest) -> dict[str, Any]:
    return {"step": m.step, "chunk_bytes": m.chunk_bytes, "entries": [e.doc() for e in m.entries], "proof": m.proof}


def parse_manifest(obj: dict[str, Any]) -> Manifest:
    entries = obj.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_RANGES:
        raise ProtocolError("field 'entries' must be a list")
    out = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], str)
                and isinstance(e[2], list)):
            raise ProtocolError(f"malformed manifest entry {str(e)[:200]}")
        shape = tuple(_int(d, "shape") for d in e[2])
        out.append(Entry(e[0], e[1], shape, _int(e[3], "nbytes")))
    return Manifest(_int(obj, "step"), tuple(out), _int(obj, "chunk_bytes", MIN_CHUNK, MAX_CHUNK),
                    str_field(obj, "proof", 128))


def parse_ranges(obj: dict[str, Any], entries: tuple[Entry, ...]) -> list[tuple[int, int, int]]:
    """GET's ranges, each inside its entry."""
    ranges = obj.get("ranges")
    if not isinstance(ranges, list) or not 0 < len(ranges) <= MAX_RANGES:
        raise ProtocolError(f"field 'ranges' must be a list of 1 to {MAX_RANGES} [entry, offset, length]")
    out = []
    for r in ranges:
        if not isinstance(r, list) or len(r) != 3:
            raise ProtocolError(f"malformed range {str(r)[:100]}")
        e = _int(r[0], "entry", 0, len(entries) - 1) if entries else -1
        if e < 0:
            raise ProtocolError("the snapshot has no entries")
        off = _int(r[1], "offset", 0, entries[e].nbytes)
        length = _int(r[2], "length", 1, entries[e].nbytes - off) if entries[e].nbytes > off else -1
        if length < 0:
            raise ProtocolError(f"range {r} is outside entry {e} ({entries[e].nbytes} bytes)")
        out.append((e, off, length))
    return out
