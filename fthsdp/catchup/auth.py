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
from collections.abc import Callable

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


def _mac(token: str, context: bytes, fields: tuple[str, ...]) -> str:
    """Hex HMAC-SHA256 under ``token`` of ``context`` and ``fields``, NUL-separated ('' without a token);
    ``ValueError`` when a field holds a NUL (two field lists must never give one message)."""
    if not token:
        return ""
    if any("\0" in f for f in fields):
        raise ValueError("a catch-up handshake field holds a NUL character")
    return hmac.new(token.encode(), b"\0".join([context, *(f.encode() for f in fields)]), hashlib.sha256).hexdigest()


def _answers(token: str, given: str, expected: Callable[[], str]) -> bool:
    """Whether ``given`` is the MAC ``expected()`` computes (always true without a token: loopback only)."""
    if not token:
        return True
    try:
        want = expected()
    except ValueError:
        return False
    return hmac.compare_digest(given.encode("ascii", "replace"), want.encode())


def proof(token: str, nonce: str, hello: Hello) -> str:
    """The joiner's answer to ``nonce`` for ``hello`` (its ``proof`` field is ignored): hex HMAC-SHA256, or ''
    without a token."""
    return _mac(token, CONTEXT, (nonce, hello.job, hello.replica, hello.incarnation, str(hello.rank),
                                 str(hello.step)))


def verify(token: str, nonce: str, hello: Hello) -> bool:
    """Whether ``hello.proof`` answers ``nonce`` with ``token`` (always true without a token: loopback only)."""
    return _answers(token, hello.proof, lambda: proof(token, nonce, hello))


def source_proof(token: str, hello: Hello, source: str) -> str:
    """A source's answer to the joiner's nonce (``hello.nonce``): that replica ``source`` holds the job token and
    serves ``hello``'s rank and step; '' without a token."""
    return _mac(token, SOURCE_CONTEXT, (hello.nonce, hello.job, source, str(hello.rank), str(hello.step)))


def verify_source(token: str, hello: Hello, source: str, proof: str) -> bool:
    """Whether a source's ``proof`` answers ``hello.nonce`` with ``token`` (always true without one)."""
    return _answers(token, proof, lambda: source_proof(token, hello, source))


def trace_proof(token: str, nonce: str, request: TraceRequest) -> str:
    """A timeline reader's answer to ``nonce``: hex HMAC-SHA256 of the nonce, job and ``since`` under the job
    token ('' without one). Good for one session only."""
    return _mac(token, TRACE_CONTEXT, (nonce, request.job, str(request.since)))


def verify_trace(token: str, nonce: str, request: TraceRequest) -> bool:
    """Whether ``request.proof`` answers ``nonce`` with ``token`` (always true without one: loopback only)."""
    return _answers(token, request.proof, lambda: trace_proof(token, nonce, request))


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
