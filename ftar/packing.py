"""Packing of an exchange's tensors for the data plane (docs/design.md §5): one flat buffer per dtype, plus the
contributor count, and back.

The collective runs on a private staging buffer, so a failed attempt leaves the caller's tensors intact; only a
``direct`` exchange (``keep_inputs=False``) reduces the tensors where they lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

COUNT_CARRIERS = (torch.float32, torch.float64)
"""Dtypes whose buffer carries the contributor count in one extra element (integers exact up to 2**24)."""


class Staging:
    """Staging buffers, one per dtype, reused across exchanges (a fresh 64 MB allocation costs more than the copy
    into it). Owned by one epoch's group and dropped with it: an abandoned collective may still be writing into
    its buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype`` (contents undefined)."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[dtype] = buf
        return buf[:numel]


@dataclass
class Packed:
    """An exchange laid out for the data plane: the buffers to all-reduce (SUM), in order."""

    flats: list[tuple[torch.Tensor, list[int]]]
    """One flat buffer per dtype, with the indices of the tensors it holds (in order)."""
    count: torch.Tensor | None
    """A separate int64 contributor count, when no float buffer carries it (its last element)."""
    direct: bool
    """The buffers are the caller's tensors themselves (reduced in place, no private copy)."""

    def buffers(self) -> list[torch.Tensor]:
        """What to all-reduce."""
        out = [flat for flat, _ in self.flats]
        return out + [self.count] if self.count is not None else out

    def contributors(self) -> int:
        """The reduced contributor count (read once the buffers are reduced)."""
        if self.count is not None:
            return int(self.count.item())
        return int(self.flats[0][0][-1].item())


def pack(tensors: Sequence[torch.Tensor], *, contribute: bool, keep_inputs: bool, staging: Staging) -> Packed:
    """Lay ``tensors`` out for one all-reduce. A non-contributor sends zeros and a count of 0. With
    ``keep_inputs=False``, when every dtype has a single contiguous tensor, the tensors are used directly."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    direct = (not keep_inputs and contribute
              and all(len(idx) == 1 and tensors[idx[0]].is_contiguous() for idx in groups.values()))
    if direct:
        flats = [(tensors[idx[0]].view(-1), idx) for idx in groups.values()]
        return Packed(flats, _count(contribute, staging.device), True)
    carrier = next((d for d in groups if d in COUNT_CARRIERS), None)
    flats = []
    for dtype, idx in groups.items():
        numel = sum(tensors[i].numel() for i in idx)
        flat = staging.get(dtype, numel + (1 if dtype == carrier else 0))
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            if contribute:
                flat[offset: offset + n].copy_(tensors[i].detach().reshape(-1))
            offset += n
        if not contribute:
            flat.zero_()
        if dtype == carrier:
            flat[-1] = 1.0 if contribute else 0.0
        flats.append((flat, idx))
    return Packed(flats, None if carrier is not None else _count(contribute, staging.device), False)


def _count(contribute: bool, device: torch.device) -> torch.Tensor:
    return torch.tensor([1 if contribute else 0], dtype=torch.int64, device=device)


def unpack(packed: Packed, tensors: Sequence[torch.Tensor], *, op: str, contributors: int,
           inplace: bool) -> list[torch.Tensor]:
    """The results, shaped like ``tensors``: the sums (``op="sum"``) or the sums divided by ``contributors``
    (``avg``; floor division for integers), written into ``tensors`` with ``inplace``, else into new tensors."""
    out: list[torch.Tensor] = list(tensors)
    for flat, idx in packed.flats:
        offset = 0
        for i in idx:
            t = tensors[i]
            src = flat[offset: offset + t.numel()].view(t.shape)
            offset += t.numel()
            dst = t if inplace else torch.empty_like(t)
            if op == "sum":
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            elif t.is_floating_point():
                torch.div(src, contributors, out=dst)
            else:
                torch.div(src, contributors, rounding_mode="floor", out=dst)
            out[i] = dst
    return out
