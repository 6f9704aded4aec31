"""A lane's rendezvous before a death, without a lane group: every member announces itself on a hub store and learns
the candidates' addresses there, as members do on the host's store (``ftar.lane_hosting``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from ftar.lane_hosting import LaneHosting
from ftar.lane_store import LaneStoreServer, MemberStore
from lighthouse.epoch_view import EpochView


def rendezvous_once(members: Iterable[LaneHosting], epoch: EpochView, job: str, key: str, lane: int = 0) -> None:
    """``members`` (of ``epoch``) announce on, then learn from, a hub standing in for ``lane``'s host."""
    members = list(members)
    hub = LaneStoreServer(job, key, "127.0.0.1", lambda: epoch)
    try:
        on_hub = MemberStore(hub.address, key, job, f"{job}/epoch{epoch.number}", timedelta(seconds=2))
        for h in members:
            h.announce(epoch, lane, on_hub)
        for h in members:
            h.learn(epoch, lane, on_hub)
    finally:
        hub.close()
