"""An epoch as a client sees it (what the watch stream delivers to the runtime and FTAR)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lighthouse.lane_hosts import SPREAD_FROM
from lighthouse.model import ACTIVE, EpochMember


@dataclass(frozen=True)
class EpochView:
    """An epoch as a client sees it."""

    job_id: str
    number: int
    members: tuple[EpochMember, ...]
    rendezvous: str
    created_unix: float
    reason: str
    plane: int = 0
    """The epoch whose data-plane groups this one keeps (see ``Epoch.plane`` in the proto)."""
    lane_spread_from: int = 0
    """The lighthouse's: from how many members a lane meeting on kept addresses meets on several stores (0: it did
    not say; ``spread_from`` reads it)."""

    @property
    def spread_from(self) -> int:
        """``lane_spread_from``, or ``lane_hosts.SPREAD_FROM`` from a lighthouse that did not say."""
        return self.lane_spread_from or SPREAD_FROM

    @property
    def data_plane(self) -> int:
        return self.plane or self.number

    @functools.cached_property
    def replica_ids(self) -> tuple[str, ...]:
        """The members' ids in the epoch's order (kept: a lane's ranking is cached by this tuple)."""
        return tuple(x.replica_id for x in self.members)

    @functools.cached_property
    def _by_id(self) -> dict[str, EpochMember]:
        return {x.replica_id: x for x in self.members}

    def member(self, replica_id: str) -> EpochMember | None:
        return self._by_id.get(replica_id)

    @property
    def contributors(self) -> int:
        return sum(1 for x in self.members if x.role == ACTIVE)
