"""What a checkpoint's writer vouches for, checked before anything of it is read.

torch.distributed.checkpoint reads a checkpoint's metadata with pickle, so whoever can write the checkpoint volume
could run code in every rank that resumes from it. The writer therefore seals each checkpoint: the SHA-256 of every
file in it, listed in its commit marker, and an HMAC-SHA256 of that list under the job's catch-up key (every replica
of the job holds it, nobody else: ``lighthouse.security.read_catchup_key``). A replica that resumes checks the seal
and every file's digest, its ranks sharing the files, before DCP opens any of them. Without a key (the loopback
default) the digests still catch a torn or corrupted checkpoint, not a forged one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pathlib
from collections.abc import Mapping

from fthsdp.runtime.errors import CheckpointRejected

CONTEXT = b"fthsdp-checkpoint-seal"
"""Binds a seal to this use of the key."""
_BLOCK = 1 << 20


def sealed_files(path: pathlib.Path, marker: str) -> list[str]:
    """The files a seal covers: every file in the checkpoint's folder but its commit marker (and its temporary)."""
    return sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(marker))


def digest(path: pathlib.Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def seal(key: str, files: Mapping[str, str]) -> str:
    """The writer's MAC over ``files`` (name -> digest); '' without a key."""
    if not key:
        return ""
    body = json.dumps(sorted(files.items()), separators=(",", ":")).encode()
    return hmac.new(key.encode(), CONTEXT + b"\0" + body, hashlib.sha256).hexdigest()


def check_seal(path: pathlib.Path, marker: str, files: Mapping[str, str], mac: str, key: str) -> None:
    """Raise ``CheckpointRejected`` unless ``files`` is what the job's writer sealed (with a key) and names exactly
    the files in ``path``. Cheap: reads no file's contents."""
    if key and not files:
        raise CheckpointRejected(f"checkpoint {path} carries no seal (written by an older fthsdp, or not by this "
                                 "job): refusing to read it, since loading a checkpoint runs pickle")
    if key and not hmac.compare_digest(mac.encode("ascii", "replace"), seal(key, files).encode()):
        raise CheckpointRejected(f"checkpoint {path}: its seal is not this job's (FTHSDP_TOKEN_FILE): refusing to "
                                 "read it")
    present = sealed_files(path, marker)
    if files and present != sorted(files):
        extra, missing = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        raise CheckpointRejected(f"checkpoint {path}: files differ from what was sealed (added: {extra}, missing: "
                                 f"{missing}): refusing to read it")


def check_digests(path: pathlib.Path, files: Mapping[str, str], names: list[str]) -> list[str]:
    """Of ``names`` (this rank's share), the files whose digest is not the sealed one."""
    return [n for n in names if digest(path / n) != files.get(n)]
