"""Who may fetch a snapshot (docs/design.md §6), as pure functions: the challenge-response that proves the job
token without sending it, and the admission rule a source applies before it registers (let alone copies) anything.

The source opens every session with a random nonce; the joiner answers with
``HMAC-SHA256(token, context || nonce || job || replica || incarnation || rank || step)`` (fields separated by NUL,
none of which may hold one), which the source recomputes and compares in constant time. The token itself never
crosses the wire, and a proof is good for one nonce, one joiner and one step only. The source proves the token
back the same way (``source_proof``, over the joiner's own nonce, under another context): a joiner takes a
snapshot only from a replica of its job. Without a token the source serves loopback only (``serving_allowed``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fthsdp.catchup.wire import Hello, TraceRequest
from lighthouse.epoch_view import EpochView
from lighthouse.model import JOINING
from lighthouse.security import is_loopback

CONTEXT = b"fthsdp-catchup-v2"
"""Binds a proof to this protocol (no other use of the token yields the same MAC)."""
SOURCE_CONTEXT = b"fthsdp-catchup-source-v1"
"""Binds a source's proof (a joiner's proof can never be replayed as a source's, nor the other way round)."""
TRACE_CONTEXT = b"fthsdp-timeline-v1"
"""Binds a timeline reader's proof (it opens a rank's timeline, never a snapshot)."""
NONCE_BYTES = 32


def new_nonce() -> str:
    """A fresh random challenge (hex)."""
    return secrets.token_hex(NONCE_BYTES)


def _message(nonce: str, hello: Hello) -> bytes:
    fields = (nonce, hello.job, hello.replica, hello.incarnation, str(hello.rank), str(hello.step))
    if any("\0" in f for f in fields):
        raise ValueError("a catch-up handshake field holds a NUL character")
    return b"\0".join([CONTEXT, *(f.encode() for f in fields)])


def proof(token: str, nonce: str, hello: Hello) -> str:
    """The joiner's answer to ``nonce`` for ``hello`` (its ``proof`` field is ignored): hex HMAC-SHA256, or ''
    without a token."""
    if not token:
        return ""
    return hmac.new(token.encode(), _message(nonce, hello), hashlib.sha256).hexdigest()


def verify(token: str, nonce: str, hello: Hello) -> bool:
    """Whether ``hello.proof`` answers ``nonce`` with ``token`` (always true without a token: loopback only)."""
    if not token:
        return True
    try:
        expected = proof(token, nonce, hello)
    except ValueError:
        return False
    return hmac.compare_digest(hello.proof.encode("ascii", "replace"), expected.encode())


def source_proof(token: str, hello: Hello, source: str) -> str:
    """A source's answer to the joiner's nonce (``hello.nonce``): that replica ``source`` holds the job token and
    serves ``hello``'s rank and step; '' without a token."""
    if not token:
        return ""
    fields = (hello.nonce, hello.job, source, str(hello.rank), str(hello.step))
    if any("\0" in f for f in fields):
        raise ValueError("a catch-up handshake field holds a NUL character")
    return hmac.new(token.encode(), b"\0".join([SOURCE_CONTEXT, *(f.encode() for f in fields)]),
                    hashlib.sha256).hexdigest()


def verify_source(token: str, hello: Hello, source: str, proof: str) -> bool:
    """Whether a source's ``proof`` answers ``hello.nonce`` with ``token`` (always true without one)."""
    if not token:
        return True
    return hmac.compare_digest(proof.encode("ascii", "replace"), source_proof(token, hello, source).encode())


def trace_proof(token: str, nonce: str, request: TraceRequest) -> str:
    """A timeline reader's answer to ``nonce``: hex HMAC-SHA256 of the nonce, job and ``since`` under the job
    token ('' without one). Good for one session only."""
    if not token:
        return ""
    fields = (nonce, request.job, str(request.since))
    if any("\0" in f for f in fields):
        raise ValueError("a timeline request field holds a NUL character")
    return hmac.new(token.encode(), b"\0".join([TRACE_CONTEXT, *(f.encode() for f in fields)]),
                    hashlib.sha256).hexdigest()


def verify_trace(token: str, nonce: str, request: TraceRequest) -> bool:
    """Whether ``request.proof`` answers ``nonce`` with ``token`` (always true without one: loopback only)."""
    if not token:
        return True
    try:
        expected = trace_proof(token, nonce, request)
    except ValueError:
        return False
    return hmac.compare_digest(request.proof.encode("ascii", "replace"), expected.encode())


def admit(epoch: EpochView | None, job: str, hello: Hello) -> tuple[str, str] | None:
    """The refusal (code, message) of a snapshot request, or None to honour it: only a member of the source's
    current epoch, of this job, with the joining role and the incarnation the epoch names."""
    if hello.job != job:
        return "wrong_job", f"this replica serves job {job!r}, not {hello.job[:80]!r}"
    if epoch is None:
        return "not_member", "this replica knows no epoch yet"
    member = epoch.member(hello.replica)
    if member is None:
        return "not_member", f"{hello.replica[:80]!r} is not a member of epoch {epoch.number}"
    if member.role != JOINING:
        return "not_joining", f"{hello.replica!r} is {member.role} in epoch {epoch.number}, not joining"
    if member.incarnation != hello.incarnation:
        return "stale_incarnation", (f"{hello.replica!r} is incarnation {member.incarnation!r} in epoch "
                                     f"{epoch.number}, not {hello.incarnation[:80]!r}")
    return None


def serving_allowed(host: str, token: str) -> bool:
    """A catch-up server may listen on ``host``: anywhere with a token, only on loopback without one."""
    return bool(token) or is_loopback(host)
