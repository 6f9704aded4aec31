"""Which data each rank of each replica trains next, exactly once (docs/design.md §7).

Every replica owns a data slot whose cursor (``Replica.cursor``) advances only when a step it contributed to is
committed, and comes back with the replica. ``batch_index`` turns (slot, cursor, rank) into one global batch
number, distinct for every rank of every slot at every cursor, so the ranks of a replica never train the same
batch and a batch is never trained twice. ``SlotSampler`` maps that number to the indices of a map-style dataset,
like ``torch.utils.data.DistributedSampler``: a seeded permutation per pass over the data, the same on every
replica and across restarts.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ReplicaLike(Protocol):
    """What the helpers read of a ``Replica``."""

    slot: int
    rank: int
    world_size: int

    @property
    def cursor(self) -> int: ...

    @property
    def slots(self) -> int: ...


def batch_index(slot: int, cursor: int, rank: int, slots: int, ranks: int) -> int:
    """The global number of the batch rank ``rank`` of slot ``slot`` trains at ``cursor``: every slot's step-``c``
    batches come before step ``c + 1``'s, each split in ``ranks`` consecutive numbers."""
    if not (0 <= slot < slots and 0 <= rank < ranks and cursor >= 0):
        raise ValueError(f"slot {slot} of {slots}, rank {rank} of {ranks}, cursor {cursor}: out of range")
    return (cursor * slots + slot) * ranks + rank


def next_batch(ft: ReplicaLike) -> int:
    """``batch_index`` of this rank's next batch (seed a generator with it for synthetic data)."""
    return batch_index(ft.slot, ft.cursor, ft.rank, ft.slots, ft.world_size)


class SlotSampler:
    """The indices of a map-style dataset of ``size`` items for global batch ``i``: items ``i * batch_size`` to
    ``(i + 1) * batch_size - 1`` of an endless stream that visits the dataset once per pass, in a permutation
    seeded by (``seed``, pass) when ``shuffle`` (in order otherwise). ``batch_size`` is per rank."""

    def __init__(self, size: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1 or batch_size < 1:
            raise ValueError(f"need a dataset size and a batch size of at least 1, got {size} and {batch_size}")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = (epoch, torch.randperm(self.size, generator=g))
            else:
                self._perm = (epoch, torch.arange(self.size))
        return self._perm[1]

    def indices(self, index: int) -> list[int]:
        """The dataset indices of global batch ``index``."""
        if index < 0:
            raise ValueError(f"batch index {index} < 0")
        out = []
        for pos in range(index * self.batch_size, (index + 1) * self.batch_size):
            out.append(int(self._order(pos // self.size)[pos % self.size]))
        return out

    def next(self, ft: ReplicaLike) -> list[int]:
        """The dataset indices of this rank's next batch (``next_batch``)."""
        return self.indices(next_batch(ft))
