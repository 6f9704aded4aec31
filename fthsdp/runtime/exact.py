"""The exact cross-replica sum (``FTHSDP_DETERMINISTIC=1``; docs/design.md §7, "Bitwise failure transparency").

A float sum depends on its order: the same micro-batch gradients added up by other replicas, or in another
grouping, give other bits. Here every micro-batch's gradient shard (as FSDP2's reduce-scatter hands it over) is
rounded once to fixed point, ``FRACTION_BITS`` bits after the binary point, and from then on only added as int64,
which is associative: the step's sum is the same integers whoever trained which micro-batch, in whatever order,
and its conversion back (divided by the slots trained) the same bits. The price: an FSDP2 reduce-scatter per
micro-batch (not one per step), int64 buckets (twice float32's bytes), and a rounding of each micro-batch's
gradient to a multiple of 2^-40 (about 1e-12: far below a float32 gradient's own precision at the magnitudes
training sees; a value too large for the range is refused with ``ExactRangeError``, never wrapped)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ftar import ExchangeResult
from fthsdp.runtime.state import local_tensor

FRACTION_BITS = 40
"""Bits after the binary point of the fixed-point sum: a micro-batch's gradient value is a multiple of 2^-40."""
_SCALE = float(2 ** FRACTION_BITS)


class ExactRangeError(ValueError):
    """A gradient value is not finite, or too large for the fixed-point sum to hold every contribution without
    overflowing (``limit``)."""


def limit(contributions: int) -> float:
    """The largest magnitude one micro-batch's gradient value may have so that ``contributions`` of them (the job's
    slots × micro-batches per slot) sum within int64: 2^(62 - FRACTION_BITS) / contributions."""
    return 2.0 ** (62 - FRACTION_BITS) / max(1, contributions)


def fixed(g: torch.Tensor, bound: float) -> torch.Tensor:
    """``g`` rounded to fixed point (int64, in units of 2^-FRACTION_BITS; ties to even). Raises
    ``ExactRangeError`` for a value that is not finite or exceeds ``bound`` in magnitude."""
    wide = g.detach().to(torch.float64)
    check(float(wide.abs().max()) if wide.numel() else 0.0, bound)
    return _rounded(wide)


def check(top: float, bound: float) -> None:
    """Raises ``ExactRangeError`` unless ``top`` (the largest magnitude of some gradient values) is finite and at
    most ``bound``."""
    if not math.isfinite(top) or top > bound:
        raise ExactRangeError(
            f"a gradient value of magnitude {top:g} does not fit the exact sum (FTHSDP_DETERMINISTIC=1 holds at most "
            f"{bound:g} per micro-batch, non-finite never): lower the loss scale or the learning rate, or clip "
            "earlier; the step is not exchanged")


def _rounded(wide: torch.Tensor) -> torch.Tensor:
    return torch.round(wide * _SCALE).to(torch.int64)


def to_float(total: torch.Tensor, divisor: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed-point sum ``total`` as ``dtype``, divided by ``divisor`` (the slots the step trained): the same
    bits for the same integers."""
    return (total.to(torch.float64) / _SCALE / max(1, divisor)).to(dtype)


class Accumulators:
    """One rank's fixed-point sums of a step's micro-batch gradient shards, one int64 tensor per parameter, and the
    largest magnitude folded into each (checked once per bucket, before it is exchanged: on CUDA one device sync
    per bucket, not one per parameter and micro-batch)."""

    def __init__(self, contributions: int) -> None:
        self.bound = limit(contributions)
        self._sums: dict[int, torch.Tensor] = {}
        self._tops: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        """A step begins: every sum back to zero."""
        for t in self._sums.values():
            t.zero_()
        self._tops.clear()

    def fold(self, p: torch.Tensor) -> None:
        """Add ``p``'s gradient shard (one micro-batch's, just reduce-scattered) to its sum, and zero it in place, so
        the next micro-batch's lands alone (FSDP2 adds it to the zeros, exactly)."""
        if p.grad is None:
            return
        g = local_tensor(p.grad)
        wide = g.detach().to(torch.float64)
        if wide.numel():
            top = wide.abs().max()  # NaN propagates: refused by ``check``
            seen = self._tops.get(id(p))
            self._tops[id(p)] = top if seen is None else torch.maximum(seen, top)
        self.of(p).add_(_rounded(wide))
        g.zero_()

    def check(self, params: Sequence[torch.Tensor]) -> None:
        """Raises ``ExactRangeError`` if a value folded into ``params``' sums this step did not fit."""
        tops = [self._tops[id(p)] for p in params if id(p) in self._tops]
        if tops:
            check(float(torch.stack(tops).max()), self.bound)

    def of(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s sum (zeros before its first fold)."""
        t = self._sums.get(id(p))
        if t is None:
            t = self._sums[id(p)] = torch.zeros(local_tensor(p).shape, dtype=torch.int64, device=p.device)
        return t


def averaged_extras(result: ExchangeResult, extras: int) -> ExchangeResult:
    """A summed (``op="sum"``) result whose last ``extras`` tensors are float words the rest of the runtime reads
    averaged over the contributors (the state digests, the slot mask): those divided, in new tensors (FTAR keeps
    the result it returned to serve a partner that lost it)."""
    c = result.contributors
    if not c or not extras:
        return result
    head, tail = result.tensors[:-extras], result.tensors[-extras:]
    return dataclasses.replace(result, tensors=[*head, *(t / c for t in tail)])
