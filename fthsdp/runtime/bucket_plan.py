"""Which gradient shards travel across replicas together (``plan_buckets``), and the slot mask that rides at the
end of a step's last bucket (``slot_mask``). Pure: the same on every replica."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def plan_buckets(params: Sequence[T], blocks: Sequence[Sequence[T]]) -> list[list[T]]:
    """The buckets, in exchange order: each block's parameters (the blocks last to first: backward produces
    their gradients in that order), then the root's own parameters (those of ``params`` in no block). Empty
    buckets are dropped. The same on every replica."""
    in_blocks = {id(p) for block in blocks for p in block}
    buckets = [list(block) for block in reversed(blocks)]
    buckets.append([p for p in params if id(p) not in in_blocks])
    return [b for b in buckets if b]


def slot_mask(slot: int, slots: int, contribute: bool, device: torch.device, parts: int = 0,
              dealt: Sequence[int] = ()) -> torch.Tensor:
    """Rides at the end of the last bucket: averaged, slot i is 1/contributors if its replica contributed to the
    step, 0 if not (``fthsdp.runtime.commit.contributing_slots`` reads it back). With orphan slots carried
    (``parts`` micro-batches per slot), ``slots * parts`` positions follow, 1 at each part the contribution trained
    (``dealt``: ``fthsdp.runtime.orphans.mask``)."""
    mask = torch.zeros(slots + slots * parts, dtype=torch.float32, device=device)
    if contribute:
        mask[slot] = 1.0
        if parts and dealt:
            mask[[slots + p for p in dealt]] = 1.0
    return mask
