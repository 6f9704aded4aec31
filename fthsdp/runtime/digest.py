"""The periodic state-digest check (docs/design.md §7): every K steps (``FTHSDP_DIGEST_EVERY``) the replicas
compare a 64-bit digest of their state, riding the step's exchange, and a replica whose state differs is found
within K steps.

Each contributing replica puts its digest in its own slot's positions of a small float32 tensor (zeros
elsewhere) at the end of the step's last bucket. The exchange sums, then averages, it; only one replica writes
each position, so the sum is exact, and the average times the contributor count, rounded, gives the words back
exactly: each word is a 16-bit chunk plus one (at most 65,536, far below float32's 2^24 exact integers), so 0
means "no digest from this slot". A spare has no slot, so it sends none: it checks its own digest against the
slots' majority (``strays``). Pure functions: the replica (``fthsdp.runtime.replica``) computes the digest,
and acts on the verdict."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

WORDS = 4
"""16-bit words per digest: 64 bits."""


def due(step: int, every: int) -> bool:
    """Whether the state before ``step`` is digested and compared (never with ``every`` 0)."""
    return every > 0 and step % every == 0


def words(digest: bytes) -> list[float]:
    """The first 64 bits of ``digest`` as ``WORDS`` values in 1..65536 (16-bit chunks plus one)."""
    if len(digest) < 2 * WORDS:
        raise ValueError(f"a digest of {len(digest)} bytes is shorter than {2 * WORDS}")
    return [float(int.from_bytes(digest[2 * i:2 * i + 2], "big") + 1) for i in range(WORDS)]


def pack(slot: int, slots: int, digest: bytes | None) -> list[float]:
    """This replica's contribution: its digest's words in slot ``slot``'s positions, zeros elsewhere (and
    everywhere without a digest: a joiner, a spare with no slot, or a step that is not checked)."""
    out = [0.0] * (slots * WORDS)
    if digest is not None:
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} of {slots}")
        out[slot * WORDS:(slot + 1) * WORDS] = words(digest)
    return out


def unpack(averaged: Sequence[float], contributors: int) -> dict[int, int]:
    """Per slot that sent one, its 64-bit digest, from the averaged tensor of ``pack``s."""
    if len(averaged) % WORDS:
        raise ValueError(f"{len(averaged)} values is not a whole number of {WORDS}-word digests")
    sums = [round(v * contributors) for v in averaged]
    out = {}
    for slot in range(len(sums) // WORDS):
        chunk = sums[slot * WORDS:(slot + 1) * WORDS]
        if any(chunk):
            if not all(1 <= w <= 1 << 16 for w in chunk):
                raise ValueError(f"slot {slot}'s digest words {chunk} are not 16-bit chunks plus one: two "
                                 "replicas wrote the same slot")
            out[slot] = int.from_bytes(b"".join((w - 1).to_bytes(2, "big") for w in chunk), "big")
    return out


@dataclass(frozen=True)
class Verdict:
    """What a step's digests say."""

    digests: Mapping[int, int]
    """Per contributing slot, its digest."""
    differ: tuple[int, ...]
    """The slots whose state differs from the majority's; every slot that sent one when no majority agrees."""
    majority: bool
    """More than half of the slots that sent a digest agree (always, when all agree)."""

    @property
    def agree(self) -> bool:
        return not self.differ


def bits(digest: bytes) -> int:
    """The 64 bits of ``digest`` the replicas compare, as ``unpack`` gives them back."""
    return int.from_bytes(digest[:2 * WORDS], "big")


def strays(own: int, verdict: Verdict) -> bool:
    """Whether a replica that sent no digest (a spare: no slot) holds a state other than the one the slots' strict
    majority holds. With no digest sent, or no majority (the slots stop the job: ``Verdict.majority``), there is
    nothing to hold it against: no."""
    if not verdict.digests or not verdict.majority:
        return False
    majority = Counter(verdict.digests.values()).most_common(1)[0][0]
    return own != majority


def decide(digests: Mapping[int, int]) -> Verdict:
    """Compare the digests the slots sent: all equal, or a strict majority and the slots that differ from it, or
    no majority (two replicas that differ: nobody can tell which one is right)."""
    counts = Counter(digests.values())
    if len(counts) <= 1:
        return Verdict(dict(digests), (), True)
    value, n = counts.most_common(1)[0]
    if 2 * n > len(digests):
        return Verdict(dict(digests), tuple(sorted(s for s, d in digests.items() if d != value)), True)
    return Verdict(dict(digests), tuple(sorted(digests)), False)
