"""Step reconciliation (docs/design.md §5): a member behind by whole exchanges gets their results from one that holds
them, instead of being sent away to catch up.

When a lane's group forms after a failure, one member may already have acted on exchanges another lost: with
several lanes, replica A can finish every lane of step t in epoch e (and commit it) while replica B loses one lane
to the same death and must redo the step. In the next epoch A asks for tag H (its next exchange) and B for tag
L < H. Every member that completed an exchange holds the same bytes, so a member asking for H that still holds the
results of every tag in [L, H) is a **holder**: the group's members find the lowest-ranked holder with one small
all-reduce, it broadcasts those results, and the members behind take them as the results of their exchanges, in
the epoch they were computed in. Then every member is at H. Without a holder (nobody asking for H kept the
results), the members disagree as before (``Misaligned``): the ones behind must catch up.

A lane keeps the results it acted on (``HeldResults``) until its caller says they can go (``forget_before``); the
fthsdp runtime keeps the last committed step's, so holding costs one more copy of the replica's gradient shard
(while the next step's exchange runs). A caller that uses a result in place must not change it (the runtime makes
it the parameters' ``.grad`` only with an optimizer that never changes ``.grad``); as a backstop, a result whose
version counter moved since it was recorded is no longer held (this sees in-place ops on plain tensors, not those
on a DTensor, which leave the local tensor's counter alone).

This module is pure (the holder rule, the held results, the layout of a service on the wire); the broadcasts are
the engine's (``ftar.engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ftar.errors import FTARError
from ftar.rules import NO_TAG

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
"""The dtypes a service can carry, by their code (index) on the wire."""


@dataclass(frozen=True)
class Held:
    """The result of one exchange, as this lane acted on it."""

    tensors: tuple[torch.Tensor, ...]
    epoch: int
    """The epoch it was computed in (a served result keeps its holder's)."""
    contributors: int


class HeldResults:
    """The results this lane acted on, by tag, until ``forget_before``."""

    def __init__(self) -> None:
        self._by_tag: dict[int, Held] = {}
        self._versions: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._by_tag)

    def record(self, tag: int, held: Held) -> None:
        """``tag``'s result is ``held`` (a later exchange of the same tag replaces an earlier one)."""
        self._by_tag[tag] = held
        self._versions[tag] = _versions(held)

    def get(self, tag: int) -> Held | None:
        """``tag``'s result, if held and not changed in place since."""
        held = self._by_tag.get(tag)
        return held if held is not None and _versions(held) == self._versions[tag] else None

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every tag in ``[lo, hi)`` is held, unchanged."""
        return 0 <= hi - lo <= len(self._by_tag) and all(self.get(t) is not None for t in range(lo, hi))

    def span(self, lo: int, hi: int) -> list[tuple[int, Held]]:
        """The held results of ``[lo, hi)``, in tag order (every one must be held)."""
        return [(t, self._by_tag[t]) for t in range(lo, hi)]

    def forget_before(self, tag: int) -> None:
        """Drop the results of every tag below ``tag``."""
        for t in [t for t in self._by_tag if t < tag]:
            del self._by_tag[t], self._versions[t]


def _versions(held: Held) -> tuple[int, ...]:
    """The version counters of ``held``'s tensors: each in-place change moves its counter."""
    return tuple(t._version for t in held.tensors)


# --- who serves -------------------------------------------------------------------------------------------------


def needs_reconciling(highest: int, lowest: int) -> bool:
    """After the tag check (highest and lowest tag of the members that know theirs): whether the members look
    for a holder. Every member decides this from the same reduced values, so all run the same collectives."""
    return highest != NO_TAG and highest != lowest


def holder_probe(tag: int | None, highest: int, lowest: int, held: HeldResults, rank: int, world: int) -> list[int]:
    """What a member contributes to the holder all-reduce (MAX): ``world - rank`` if it asks for ``highest`` and
    holds every result of ``[lowest, highest)``, else 0; the MAX names the lowest-ranked holder."""
    return [world - rank if tag == highest and held.covers(lowest, highest) else 0]


def holder_of(reduced: Sequence[int], world: int) -> int | None:
    """The holder's rank from the reduced probe (None: no member holds the results)."""
    return world - int(reduced[0]) if reduced[0] > 0 else None


# --- a service on the wire --------------------------------------------------------------------------------------


def header(items: Sequence[tuple[int, Held]]) -> list[int]:
    """The first broadcast: how many results and tensors follow."""
    return [len(items), sum(len(h.tensors) for _, h in items)]


def meta(items: Sequence[tuple[int, Held]]) -> list[int]:
    """The second: per result ``[tag, epoch, contributors, tensors]``, then per tensor ``[dtype code, numel]``."""
    out: list[int] = []
    for tag, h in items:
        out += [tag, h.epoch, h.contributors, len(h.tensors)]
    for _, h in items:
        for t in h.tensors:
            out += [DTYPES.index(t.dtype), t.numel()]
    return out


def meta_size(head: Sequence[int]) -> int:
    results, tensors = int(head[0]), int(head[1])
    return 4 * results + 2 * tensors


@dataclass(frozen=True)
class Layout:
    """A service as described by its header and meta: per result (tag, epoch, contributors, its tensors' indices)
    and per tensor (dtype, numel), then the flat buffers (one per dtype, in order of first use)."""

    results: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    tensors: tuple[tuple[torch.dtype, int], ...]

    @property
    def flats(self) -> list[tuple[torch.dtype, int]]:
        """The flat buffers that follow: (dtype, total numel), one per dtype in order of first use."""
        totals: dict[torch.dtype, int] = {}
        for dtype, numel in self.tensors:
            totals[dtype] = totals.get(dtype, 0) + numel
        return list(totals.items())

    def split(self, flats: Sequence[torch.Tensor]) -> dict[int, Held]:
        """The results, from the received flat buffers (1-D tensors; the caller reshapes them)."""
        offsets = {dtype: 0 for dtype, _ in self.flats}
        buffers = {dtype: flat for (dtype, _), flat in zip(self.flats, flats, strict=True)}
        pieces = []
        for dtype, numel in self.tensors:
            pieces.append(buffers[dtype][offsets[dtype]: offsets[dtype] + numel])
            offsets[dtype] += numel
        return {tag: Held(tuple(pieces[i] for i in idx), epoch, contributors)
                for tag, epoch, contributors, idx in self.results}


def parse(head: Sequence[int], described: Sequence[int]) -> Layout:
    """The layout of a service from its header and meta (``FTARError`` if they do not add up)."""
    results, tensors = int(head[0]), int(head[1])
    if len(described) != 4 * results + 2 * tensors:
        raise FTARError(f"reconciliation: meta of {len(described)} ints for {results} results, {tensors} tensors")
    out, first = [], 0
    for r in range(results):
        tag, epoch, contributors, count = (int(x) for x in described[4 * r: 4 * r + 4])
        out.append((tag, epoch, contributors, tuple(range(first, first + count))))
        first += count
    if first != tensors:
        raise FTARError(f"reconciliation: results name {first} tensors, header {tensors}")
    base = 4 * results
    shapes = []
    for i in range(tensors):
        code, numel = int(described[base + 2 * i]), int(described[base + 2 * i + 1])
        if not 0 <= code < len(DTYPES) or numel < 0:
            raise FTARError(f"reconciliation: tensor {i}: dtype code {code}, numel {numel}")
        shapes.append((DTYPES[code], numel))
    return Layout(tuple(out), tuple(shapes))


def flatten(items: Sequence[tuple[int, Held]], layout: Layout, device: torch.device) -> list[torch.Tensor]:
    """The holder's flat buffers of a service (``layout`` is ``parse(header(items), meta(items))``)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {dtype: [] for dtype, _ in layout.flats}
    for _, h in items:
        for t in h.tensors:
            by_dtype[t.dtype].append(t.detach().reshape(-1))
    return [torch.cat(by_dtype[dtype]).to(device) if by_dtype[dtype] else torch.empty(0, dtype=dtype, device=device)
            for dtype, _ in layout.flats]


def shaped_like(held: Held, tensors: Sequence[torch.Tensor], tag: int) -> list[torch.Tensor]:
    """A served result in the shapes of the caller's tensors (``FTARError`` if it does not fit them)."""
    if len(held.tensors) != len(tensors) or any(h.numel() != t.numel() or h.dtype != t.dtype
                                                for h, t in zip(held.tensors, tensors, strict=True)):
        raise FTARError(f"reconciliation: the served result of tag {tag} does not fit this exchange's tensors")
    return [h.view(t.shape) for h, t in zip(held.tensors, tensors, strict=True)]
