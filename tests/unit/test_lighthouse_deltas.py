"""Epoch deltas (``lighthouse.deltas``), the job's chain of them (``Job.update_for``) and their application on the
client (``proto_codec.apply_delta``): a delta applied to its base gives exactly the full epoch, and an epoch change
costs bytes in proportion to what changed."""

from __future__ import annotations

import asyncio
import random

import pytest

from lighthouse import deltas, lane_hosts
from lighthouse import membership as m
from lighthouse.epoch_view import EpochView
from lighthouse.model import Endpoints, Epoch, EpochMember
from lighthouse.proto_codec import DeltaView, apply_delta, epoch_from_pb, epoch_to_pb, update_from_bytes, view_to_pb
from lighthouse.server.jobs import DELTA_HISTORY, Job, Waker
from lighthouse.v1 import lighthouse_pb2 as pb


def _member(rid: str, inc: str = "1", role: str = m.ACTIVE, catchup: str = "") -> EpochMember:
    return EpochMember(rid, inc, role, 1, Endpoints(catchup=catchup))


def _epochs(seed: int, count: int, size: int) -> list[Epoch]:
    """A random walk of epochs: members die, come back as new incarnations, turn active, change endpoints."""
    rng = random.Random(seed)
    members = {f"r{i:03d}": _member(f"r{i:03d}") for i in range(size)}
    out = []
    for n in range(1, count + 1):
        for _ in range(rng.randint(0, 3)):
            rid = f"r{rng.randrange(size + 5):03d}"
            kind = rng.choice(("die", "back", "role", "endpoint"))
            if kind == "die":
                members.pop(rid, None)
            elif kind == "back":
                members[rid] = _member(rid, inc=f"{n}", role=m.JOINING)
            elif rid in members and kind == "role":
                members[rid] = _member(rid, members[rid].incarnation, m.ACTIVE)
            elif rid in members:
                members[rid] = _member(rid, members[rid].incarnation, members[rid].role, catchup=f"h:{n}")
        out.append(Epoch(n, tuple(members[k] for k in sorted(members)), float(n), f"epoch {n}"))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_delta_applied_to_its_base_is_the_epoch(seed: int) -> None:
    epochs = _epochs(seed, 12, 8)
    for a, b in zip(epochs, epochs[1:], strict=False):
        d = deltas.diff(a.number, a.members, b.number, b.members)
        assert deltas.apply(a.members, d.upserted, d.removed) == b.members
    # Composed over any stretch of the chain: the same as the full epoch at its end.
    chain = [deltas.diff(a.number, a.members, b.number, b.members) for a, b in zip(epochs, epochs[1:], strict=False)]
    for i in range(len(chain)):
        for j in range(i + 1, len(chain) + 1):
            c = deltas.compose(chain[i:j])
            assert (c.base, c.number) == (epochs[i].number, epochs[j].number)
            assert deltas.apply(epochs[i].members, c.upserted, c.removed) == epochs[j].members


def test_compose_refuses_a_gap_and_nothing() -> None:
    a = deltas.Delta(1, 2, (), ())
    with pytest.raises(ValueError, match="not consecutive"):
        deltas.compose([a, deltas.Delta(3, 4, (), ())])
    with pytest.raises(ValueError):
        deltas.compose([])


def test_a_death_in_a_big_epoch_is_one_removed_id() -> None:
    before = tuple(_member(f"r{i:05d}") for i in range(5000))
    d = deltas.diff(7, before, 8, before[:-1])
    assert d.upserted == () and d.removed == ("r04999",)


def _full(raw: bytes) -> bool:
    return pb.SessionUpdate.FromString(raw).WhichOneof("update") in ("epoch", "epoch_zlib")


def _job_at(epochs: list[Epoch]) -> Job:
    job = Job("default", m.State(), "", 0.0)
    for e in epochs:
        job.set_epoch(e)
    job.state = m.State(epoch=epochs[-1], last_number=epochs[-1].number)
    return job


def test_a_session_gets_a_delta_from_the_epoch_it_holds_and_the_full_epoch_otherwise() -> None:
    epochs = _epochs(3, 10, 2000)
    job = _job_at(epochs)
    full = update_from_bytes(job.update_for(0))
    assert _full(job.update_for(0)) and full.number == 10
    for held in (9, 5, 1):  # one behind, several behind (composed): a delta against what it holds
        raw = job.update_for(held)
        u = update_from_bytes(raw)
        assert isinstance(u, DeltaView) and (u.base, u.number) == (held, 10)
        base = epoch_from_pb(pb.Epoch(job_id="default", number=held,
                                      members=[pb.Member(replica_id=x.replica_id, incarnation=x.incarnation,
                                                         role=pb.ROLE_ACTIVE if x.role == m.ACTIVE
                                                         else pb.ROLE_JOINING, shard_count=1,
                                                         endpoints=pb.Endpoints(catchup=x.endpoints.catchup))
                                               for x in epochs[held - 1].members]))
        assert apply_delta(base, u).members == epochs[-1].members
        assert len(raw) < len(job.epoch_bytes) / 20  # O(changed), not O(members)
    for held in (11, 12345):  # unknown to the chain (or ahead of it): the full epoch, cached once
        assert _full(job.update_for(held))
    assert set(job._updates) == {0, 9, 5, 1}


def test_the_chain_is_bounded_and_a_restore_starts_it_over() -> None:
    epochs = _epochs(4, DELTA_HISTORY + 10, 10)
    job = _job_at(epochs)
    last = epochs[-1].number
    assert update_from_bytes(job.update_for(last - DELTA_HISTORY)).base == last - DELTA_HISTORY  # type: ignore[union-attr]
    assert _full(job.update_for(last - DELTA_HISTORY - 1))
    job.restore(m.State(epoch=epochs[-1], last_number=last), 0.0)  # another lighthouse's state: no deltas
    assert _full(job.update_for(last - 1))


def test_the_lighthouses_lane_spread_reaches_every_member_in_full_epochs_and_deltas_alike() -> None:
    """``--lane-spread-from`` is one number for the whole job (a member that spread and one that did not would look
    for each other's keys on different stores): the lighthouse stamps it on every epoch it pushes, whole or as a
    delta, and on the view a group's rank 0 relays to its other ranks; 0, an older lighthouse's, reads as the
    default."""
    epochs = _epochs(5, 6, 10)
    job = Job("default", m.State(), "", 0.0, spread_from=2)
    for e in epochs:
        job.set_epoch(e)
    job.state = m.State(epoch=epochs[-1], last_number=epochs[-1].number)
    full = update_from_bytes(job.update_for(0))
    assert isinstance(full, EpochView) and (full.lane_spread_from, full.spread_from) == (2, 2)
    delta = update_from_bytes(job.update_for(4))
    assert isinstance(delta, DeltaView) and delta.lane_spread_from == 2
    base = epoch_from_pb(epoch_to_pb("default", epochs[3], "", 2))
    after = apply_delta(base, delta)
    assert after.members == epochs[-1].members and after.spread_from == 2
    assert epoch_from_pb(view_to_pb(after)) == after  # rank 0 to its group's ranks: the same view
    unsaid = epoch_from_pb(epoch_to_pb("default", epochs[-1], ""))
    assert (unsaid.lane_spread_from, unsaid.spread_from) == (0, lane_hosts.SPREAD_FROM)


def test_a_delta_against_another_epoch_is_refused() -> None:
    epochs = _epochs(5, 3, 4)
    job = _job_at(epochs)
    u = update_from_bytes(job.update_for(2))
    assert isinstance(u, DeltaView)
    other = epoch_from_pb(pb.Epoch(job_id="default", number=1))
    with pytest.raises(ValueError, match="does not apply"):
        apply_delta(other, u)


def test_a_wake_kicks_every_session_once_and_a_kick_is_kept_until_waited_for() -> None:
    async def scenario() -> None:
        job = Job("default", m.State(), "", 0.0)
        a, b = Waker(), Waker()
        job.sessions |= {a, b}
        waiting = asyncio.create_task(a.wait())
        job.wake()  # before or after the task started waiting: either way it returns
        await asyncio.wait_for(waiting, 1)
        await asyncio.wait_for(b.wait(), 1)  # kicked before it waited: returns at once
        assert not a._kicked and not b._kicked  # each kick was used up by one wait

    asyncio.run(scenario())


def test_a_big_full_epoch_goes_compressed_and_reads_back_the_same() -> None:
    epochs = _epochs(6, 2, 2000)
    job = _job_at(epochs)
    raw = job.update_for(0)
    assert pb.SessionUpdate.FromString(raw).WhichOneof("update") == "epoch_zlib"
    assert len(raw) < len(job.epoch_bytes) / 2
    view = update_from_bytes(raw)
    assert not isinstance(view, DeltaView) and view.members == epochs[-1].members and view.number == 2


def test_a_compressed_epoch_over_the_limit_is_refused() -> None:
    import zlib

    from google.protobuf.message import DecodeError

    from lighthouse.proto_codec import MAX_EPOCH_BYTES

    bomb = pb.SessionUpdate(epoch_zlib=zlib.compress(b"\x00" * (MAX_EPOCH_BYTES + 10))).SerializeToString()
    with pytest.raises(DecodeError, match="larger than"):
        update_from_bytes(bomb)
