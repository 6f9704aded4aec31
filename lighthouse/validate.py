"""Validation of what arrives on the wire: identifiers, free text and the size limits the lighthouse enforces.
Pure functions; a bad field raises ``ValidationError`` naming it (answered as INVALID_ARGUMENT)."""

from __future__ import annotations

import re

from lighthouse.errors import ValidationError

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""Matched with ``fullmatch`` (a ``$`` anchor would let a trailing newline through)."""
ENDPOINT_MAX = 256
REASON_MAX = 1024
SHARD_MAX = 1 << 20
EPOCH_MAX = 1 << 53
"""Largest epoch number a request may name (JSON documents and Python floats keep it exact)."""
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest request the server accepts; larger ones get RESOURCE_EXHAUSTED before any handler runs."""


def check_digest(value: str) -> bool:
    """Whether a heartbeat's state digest is well formed: 1 to 64 hexadecimal digits."""
    return 0 < len(value) <= 64 and all(c in "0123456789abcdefABCDEF" for c in value)


def check_id(field: str, value: str) -> str:
    """``value`` if it is a valid identifier (job, replica, incarnation)."""
    if not value:
        raise ValidationError(f"{field} is empty")
    if not ID_RE.fullmatch(value):
        raise ValidationError(f"{field} {value[:40]!r}{'…' if len(value) > 40 else ''} is not 1-128 characters of "
                              "letters, digits, '.', '_', ':' or '-' (starting with a letter or digit)")
    return value


def check_text(field: str, value: str, limit: int = REASON_MAX) -> str:
    """``value`` if it is at most ``limit`` characters."""
    if len(value) > limit:
        raise ValidationError(f"{field} is longer than {limit} characters")
    return value


LAYOUT = re.compile(r"[A-Za-z0-9_]{0,256}")
"""A replica layout: its mesh's dimensions, each name and size (``dp2xtp2``); letters, digits and ``_``."""


def check_layout(value: str) -> str:
    """``value`` if it can name a replica layout (empty: none named)."""
    if not LAYOUT.fullmatch(value):
        raise ValidationError(f"layout must be at most 256 letters, digits or '_' (like 'dp2xtp2'), got {value[:80]!r}")
    return value


def check_shard_count(value: int) -> int:
    """``value`` if it is a usable shard count."""
    if not 1 <= value <= SHARD_MAX:
        raise ValidationError(f"shard_count must be in 1..{SHARD_MAX}, got {value}")
    return value


def check_epoch(field: str, value: int) -> int:
    """``value`` if it is a usable epoch number (a client cannot push numbering to the end of uint64)."""
    if value > EPOCH_MAX:
        raise ValidationError(f"{field} must be at most {EPOCH_MAX}, got {value}")
    return value
