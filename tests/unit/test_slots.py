"""Data slots and spares at the lighthouse (``lighthouse.slots``, through ``lighthouse.membership.decide``): who
trains which slot, in every epoch; a dead member's slot handed to a spare in the epoch that drops it."""

from __future__ import annotations

import dataclasses

import pytest

from lighthouse import membership as m
from lighthouse import slots
from lighthouse.model import NO_SLOT
from lighthouse.state_doc import state_from_doc, state_to_doc

P = m.Policy(min_replicas=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, confirm_age_s=1.0)
EP = m.Endpoints()
SLOTS = 2


def apply(state: m.State, event: m.Event, policy: m.Policy = P) -> m.State:
    out = m.decide(state, event, policy)
    assert out.rejection is None, out.rejection
    return out.state


def register(state: m.State, rid: str, slot: int, now: float = 0.0, n: int = 1, policy: m.Policy = P) -> m.State:
    return apply(state, m.Register(rid, f"{rid}-{n}", 1, EP, now, slot=slot, slots=SLOTS), policy)


def held(state: m.State) -> dict[str, int]:
    assert state.epoch is not None
    return {x.replica_id: x.slot for x in state.epoch.members}


def boot() -> m.State:
    """Slots 0 and 1 (r0, r1) and a spare (s0), all active in the first epoch."""
    policy = dataclasses.replace(P, expected_replicas=3, join_window_s=0.0)
    state = m.State()
    for rid, slot in (("r0", 0), ("r1", 1), ("s0", NO_SLOT)):
        state = register(state, rid, slot, policy=policy)
    assert held(state) == {"r0": 0, "r1": 1, "s0": NO_SLOT}
    return state


def kill(state: m.State, rid: str, now: float) -> m.State:
    """``rid``'s process died: a peer reports it, its connection closed."""
    assert state.epoch is not None
    other = next(x for x in state.epoch.replica_ids() if x != rid)
    seen = {x: now for x in state.members}
    return apply(state, m.Report(other, state.members[other].incarnation, rid, state.epoch.number, "broken", now,
                                 seen, disconnected_s=0.1))


def test_a_dead_members_slot_goes_to_the_active_spare_in_the_epoch_that_drops_it() -> None:
    state = kill(boot(), "r1", 5.0)
    assert held(state) == {"r0": 0, "s0": 1}
    # Back, r1 asks for its slot: it is held, so it comes in as a spare (joining), and stays one once active.
    state = register(state, "r1", 1, 6.0, n=2)
    assert state.members["r1"].slot == NO_SLOT and state.members["r1"].role == m.JOINING
    state = apply(state, m.Ready("r1", "r1-2", m.JOINING, 6.5))
    state = apply(state, m.Ready("r1", "r1-2", m.ACTIVE, 7.0))
    assert held(state) == {"r0": 0, "s0": 1, "r1": NO_SLOT}


def test_with_no_spare_the_slot_waits_for_its_replica_and_a_joiner_takes_a_free_one() -> None:
    policy = dataclasses.replace(P, expected_replicas=2, join_window_s=0.0)
    state = register(register(m.State(), "r0", 0, policy=policy), "r1", 1, policy=policy)
    state = kill(state, "r1", 5.0)
    assert held(state) == {"r0": 0}  # nobody to hand slot 1 to
    state = register(state, "r1", 1, 6.0, n=2)
    assert state.members["r1"].slot == NO_SLOT  # none until in the data plane
    state = apply(state, m.Ready("r1", "r1-2", m.JOINING, 6.5))
    assert held(state) == {"r0": 0, "r1": 1}  # free: it gets its own slot back
    # A spare that comes while a slot is free takes it once in the data plane.
    state = kill(state, "r1", 7.0)
    state = register(state, "s0", NO_SLOT, 8.0)
    assert state.members["s0"].slot == NO_SLOT
    state = apply(state, m.Ready("s0", "s0-1", m.JOINING, 8.5))
    assert held(state) == {"r0": 0, "s0": 1}


def test_after_every_replica_died_each_gets_the_slot_it_asked_for_whoever_comes_back_first() -> None:
    """Found by ``test_every_replica_dies_job_resumes_from_checkpoint``: replica 1 came back first, alone, and was
    handed slot 0 (the lowest free one), so it trained slot 0's batches from slot 1's place."""
    policy = dataclasses.replace(P, expected_replicas=2, join_window_s=0.0)
    state = register(register(m.State(), "r0", 0, policy=policy), "r1", 1, policy=policy)
    state = apply(state, m.Tick(10.0, {x: 0.0 for x in state.members}))  # both silent past the timeout: dead
    assert not state.members
    state = register(state, "r1", 1, 11.0, n=2)
    assert held(state) == {"r1": 1}
    state = register(state, "r0", 0, 12.0, n=2)
    state = apply(state, m.Ready("r0", "r0-2", m.JOINING, 12.5))
    assert held(state) == {"r1": 1, "r0": 0}


def test_active_spares_are_preferred_then_the_replica_that_asked() -> None:
    state = boot()
    state = register(state, "s1", NO_SLOT, 1.0)
    state = apply(state, m.Ready("s1", "s1-1", m.JOINING, 1.5))
    # r1 restarts (a new incarnation) while the spare s1 is still joining: the active spare s0 takes slot 1.
    state = register(state, "r1", 1, 2.0, n=2)
    assert held(state)["s0"] == 1 and state.members["r1"].slot == NO_SLOT
    assert held(state)["s1"] == NO_SLOT


def test_no_two_members_ever_hold_one_slot() -> None:
    state = boot()
    for now, event in enumerate([("kill", "r0"), ("reg", "r0"), ("kill", "s0"), ("reg", "s0"), ("kill", "r1")]):
        kind, rid = event
        if kind == "kill":
            state = kill(state, rid, 10.0 + now)
        else:
            state = register(state, rid, 0 if rid == "r0" else NO_SLOT, 10.0 + now, n=2 + now)
            for role in (m.JOINING, m.ACTIVE):
                state = apply(state, m.Ready(rid, state.members[rid].incarnation, role, 10.2 + now))
        taken = [x.slot for x in state.members.values() if x.slot != NO_SLOT]
        assert len(taken) == len(set(taken)), state.members
        assert state.epoch is not None
        listed = [x.slot for x in state.epoch.members if x.slot != NO_SLOT]
        assert len(listed) == len(set(listed)) and set(listed) <= set(range(SLOTS))


@pytest.mark.parametrize(("slot", "slots", "match"), [
    (2, 2, "outside"), (-2, 2, "outside"), (0, -1, "slots must be"), (0, 3, "has 2 data slots")])
def test_bad_slot_requests_are_refused_and_change_nothing(slot: int, slots: int, match: str) -> None:
    state = boot()
    out = m.decide(state, m.Register("x", "x-1", 1, EP, 1.0, slot=slot, slots=slots), P)
    assert out.rejection is not None and out.rejection.code == "INVALID_ARGUMENT"
    assert match in out.rejection.message and out.state is state


def test_a_client_that_names_no_slots_gets_none_and_hands_out_nothing() -> None:
    state = apply(m.State(), m.Register("a", "a-1", 1, EP, 0.0, slot=0))  # slots=0: the slot is ignored
    assert state.slots == 0 and held(state) == {"a": NO_SLOT}
    assert slots.assign(state) is state


def test_slots_survive_the_state_document() -> None:
    state = kill(boot(), "r1", 5.0)
    back = state_from_doc(state_to_doc(state), 6.0)
    assert back.slots == SLOTS and back.epoch == state.epoch
    assert {rid: x.slot for rid, x in back.members.items()} == {"r0": 0, "s0": 1}


@pytest.mark.parametrize("orphan_planes", [False, True])
def test_with_orphan_planes_a_change_of_slot_holders_starts_a_new_data_plane(orphan_planes: bool) -> None:
    """``Policy.orphan_planes`` (orphan slots carried, ``fthsdp.runtime.orphans``): the holders deal the orphans'
    micro-batches from the active slot holders, so every epoch of one data plane must list the same ones. A joiner
    turned active with its slot back changes them: a new plane, where without the policy only its role changed and
    the plane is kept."""
    policy = dataclasses.replace(P, expected_replicas=2, join_window_s=0.0, orphan_planes=orphan_planes)
    state = register(register(m.State(), "r0", 0, policy=policy), "r1", 1, policy=policy)
    state = kill(state, "r1", 5.0)
    state = register(state, "r1", 1, 6.0, n=2, policy=policy)
    joined = apply(state, m.Ready("r1", "r1-2", m.JOINING, 6.5), policy)
    assert held(joined) == {"r0": 0, "r1": 1} and joined.epoch is not None
    assert joined.epoch.holders_key() == (("r0", 0),)  # a joiner holds its slot but trains nothing yet
    active = apply(joined, m.Ready("r1", "r1-2", m.ACTIVE, 7.0), policy)
    assert active.epoch is not None and active.epoch.holders_key() == (("r0", 0), ("r1", 1))
    assert active.epoch.number == joined.epoch.number + 1
    assert (active.epoch.data_plane == active.epoch.number) is orphan_planes  # new plane only with the policy
    assert (active.epoch.data_plane == joined.epoch.data_plane) is not orphan_planes


def test_status_names_the_slots_whose_batches_wait() -> None:
    from lighthouse.slots import waiting_slots

    policy = dataclasses.replace(P, expected_replicas=2, join_window_s=0.0)
    assert waiting_slots(register(m.State(), "r0", 0, policy=policy)) == ()  # no epoch yet
    state = register(register(m.State(), "r0", 0, policy=policy), "r1", 1, policy=policy)
    assert waiting_slots(state) == ()
    state = kill(state, "r1", 5.0)
    assert waiting_slots(state) == (1,)  # no spare: slot 1's batches wait
    state = apply(register(state, "r1", 1, 6.0, n=2), m.Ready("r1", "r1-2", m.JOINING, 6.5))
    assert held(state) == {"r0": 0, "r1": 1} and waiting_slots(state) == (1,)  # a joiner trains no batch yet
    state = apply(state, m.Ready("r1", "r1-2", m.ACTIVE, 7.0))
    assert waiting_slots(state) == ()
    assert waiting_slots(kill(boot(), "r1", 5.0)) == ()  # the spare took it in the epoch that dropped r1
    assert waiting_slots(dataclasses.replace(state, slots=0)) == ()  # a job that names no slots


def test_the_waiting_slots_go_out_over_http_and_grpc() -> None:
    from lighthouse.server.status import StatusView, to_json, to_pb
    from lighthouse.v1 import lighthouse_pb2 as pb

    view = StatusView(job="j", leader=True, leader_address="", address="", epoch=3, rendezvous="", min_replicas=1,
                      heartbeat_timeout_s=3.0, members=(), history=(), waiting_slots=(1, 3))
    assert to_json(view)["waiting_slots"] == [1, 3]
    assert list(to_pb(view, pb.Epoch()).waiting_slots) == [1, 3]
    assert to_json(dataclasses.replace(view, waiting_slots=()))["waiting_slots"] == []


def test_steps_without_a_holder_are_counted_per_slot_across_spells() -> None:
    from lighthouse.slots import OrphanSteps

    o = OrphanSteps()
    o.observe((), 0)
    assert o.counts(5) == {}
    o.observe((1,), 10)  # slot 1 lost its holder at step 10
    assert o.counts(14) == {1: 4}
    o.observe((1, 2), 15)  # slot 2 too; slot 1's spell goes on
    o.observe((2,), 22)  # slot 1 held again at step 22
    assert o.counts(30) == {1: 12, 2: 15}
    o.observe((1,), 40)  # slot 1 a second time; slot 2 held again
    assert o.counts(45) == {1: 17, 2: 25}
    o.observe((), 44)  # a heartbeat behind the last count: a spell never goes negative
    assert o.counts(50) == {1: 16, 2: 25}


def test_a_lighthouse_job_counts_its_orphan_steps_at_each_epoch_and_status_says_so() -> None:
    from lighthouse.server.jobs import Job
    from lighthouse.server.status import StatusView, to_json

    policy = dataclasses.replace(P, expected_replicas=2, join_window_s=0.0, orphan_planes=True)
    state = register(register(m.State(), "r0", 0, policy=policy), "r1", 1, policy=policy)
    job = Job("default", state, "", 0.0)
    job.steps = {"r0": 10, "r1": 9}
    job.state = kill(state, "r1", 5.0)
    job.set_epoch(job.state.epoch)  # slot 1 without a holder from the job's step 10
    job.steps["r0"] = 17
    assert job.orphan_steps.counts(job.step) == {1: 7}
    view = StatusView(job="j", leader=True, leader_address="", address="", epoch=3, rendezvous="", min_replicas=1,
                      heartbeat_timeout_s=3.0, members=(), history=(), waiting_slots=(1,),
                      orphan_steps=tuple(job.orphan_steps.counts(job.step).items()), orphans_carried=True)
    assert to_json(view)["orphan_steps"] == {"1": 7} and to_json(view)["orphans_carried"] is True
    from lighthouse.server.status import to_pb
    from lighthouse.v1 import lighthouse_pb2 as pb

    reply = to_pb(view, pb.Epoch())  # gRPC's Status says the same
    assert dict(reply.orphan_steps) == {1: 7} and reply.orphans_carried
