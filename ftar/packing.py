"""Packing of an exchange's tensors for the data plane (docs/design.md §5): one flat buffer per dtype, the first
float one whose sums stay exact ending with the trailer (the contributor count and the tag proof), and back.

The collective runs on a private staging buffer, so a failed attempt leaves the caller's tensors intact; only a
``direct`` exchange (``keep_inputs=False``) reduces the tensors where they lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ftar.rules import PROOF_MAX

CARRIER_EXACT = {torch.float32: 2**24, torch.float64: 2**53}
"""Dtypes whose buffer can carry the trailer (the contributor count and the tag proof) in extra elements, with the
integer below which their sums stay exact."""


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
    """One flat buffer per dtype, with the indices of the tensors it holds (in order); the carrier's ends with the
    trailer."""
    trailer: torch.Tensor
    """``[contributor count, *tag proof]``: a view of the carrier's last elements, or an int64 tensor of its own
    (reduced as one more buffer) when no float buffer can carry it."""
    separate: bool
    """The trailer is a buffer of its own."""
    direct: bool
    """The buffers are the caller's tensors themselves (reduced in place, no private copy)."""

    def buffers(self) -> list[torch.Tensor]:
        """What to all-reduce."""
        out = [flat for flat, _ in self.flats]
        return out + [self.trailer] if self.separate else out

    def contributors(self) -> int:
        """The reduced contributor count (read once the buffers are reduced)."""
        return int(self.trailer[0].item())

    def proof(self) -> list[float]:
        """The reduced tag proofs (``ftar.rules.proof_holds``)."""
        return [float(x) for x in self.trailer[1:].tolist()]


def pack(tensors: Sequence[torch.Tensor], *, contribute: bool, keep_inputs: bool, staging: Staging,
         proof: Sequence[int], world: int) -> Packed:
    """Lay ``tensors`` out for one all-reduce among ``world`` members, with the trailer: the contributor count (1,
    or 0 for a non-contributor, which sends zeros) and ``proof`` (``ftar.rules.tag_proof``; every value at most
    ``ftar.rules.PROOF_MAX``). With ``keep_inputs=False``, when every dtype has a single contiguous tensor, the
    tensors are used directly."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    trailer = [1 if contribute else 0, *proof]
    direct = (not keep_inputs and contribute
              and all(len(idx) == 1 and tensors[idx[0]].is_contiguous() for idx in groups.values()))
    if direct:
        flats = [(tensors[idx[0]].view(-1), idx) for idx in groups.values()]
        return Packed(flats, _separate(trailer, staging.device), True, True)
    bound = world * PROOF_MAX  # the same choice on every member, whatever its own tag
    carrier = next((d for d in groups if d in CARRIER_EXACT and bound < CARRIER_EXACT[d]), None)
    flats = []
    tail: torch.Tensor | None = None
    for dtype, idx in groups.items():
        numel = sum(tensors[i].numel() for i in idx)
        flat = staging.get(dtype, numel + (len(trailer) if dtype == carrier else 0))
        if contribute:
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                flat[offset: offset + n].copy_(tensors[i].detach().reshape(-1))
                offset += n
        else:
            flat[:numel].zero_()
        if dtype == carrier:
            tail = flat[numel:]
            tail.copy_(torch.tensor(trailer, dtype=dtype))
        flats.append((flat, idx))
    if tail is None:
        return Packed(flats, _separate(trailer, staging.device), True, False)
    return Packed(flats, tail, False, False)


def _separate(trailer: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(trailer, dtype=torch.int64, device=device)


def unpack(packed: Packed, tensors: Sequence[torch.Tensor], *, op: str, contributors: int,
           inplace: bool) -> list[torch.Tensor]:
    """The results, shaped like ``tensors``: the sums (``op="sum"``) or the sums divided by ``contributors``
    (``avg``; floor division for integers), written into ``tensors`` with ``inplace``, else into views of one new
    flat tensor per dtype (one allocation and one division per dtype, not per tensor)."""
    out: list[torch.Tensor] = list(tensors)
    for flat, idx in packed.flats:
        offset = 0
        if inplace:
            for i in idx:
                t = tensors[i]
                _reduce_into(flat[offset: offset + t.numel()].view(t.shape), t, op, contributors)
                offset += t.numel()
            continue
        dst = torch.empty(sum(tensors[i].numel() for i in idx), dtype=flat.dtype, device=flat.device)
        _reduce_into(flat[:dst.numel()], dst, op, contributors)
        for i in idx:
            t = tensors[i]
            out[i] = dst[offset: offset + t.numel()].view(t.shape)
            offset += t.numel()
    return out


def _reduce_into(src: torch.Tensor, dst: torch.Tensor, op: str, contributors: int) -> None:
    """``dst`` = ``src`` summed (``sum``) or averaged over ``contributors`` (``avg``); ``dst`` may be ``src``."""
    if op == "sum":
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif src.is_floating_point():
        torch.div(src, contributors, out=dst)
    else:
        torch.div(src, contributors, rounding_mode="floor", out=dst)
