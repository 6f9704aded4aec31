"""The store's JSON document of a job (``lighthouse.state_doc``): it round-trips the durable state, with the
membership events, and stays small whatever the history."""

from __future__ import annotations

import dataclasses
import json

from lighthouse import membership as m
from lighthouse import state_doc
from lighthouse.model import HISTORY_LIMIT
from lighthouse.stores.memory import InMemoryStore
from tests.helpers.lighthouse import JOB


def test_state_document_round_trips_and_stays_small() -> None:
    state = m.State()
    ep = m.Endpoints("127.0.0.1:1", "127.0.0.1:2", "")
    state = m.decide(state, m.Register("a", "a1", 2, ep, 0.0), m.Policy()).state
    for i in range(100):  # 101 epochs: restarts of b
        state = m.decide(state, m.Register("b", f"b{i}", 2, ep, float(i)), m.Policy()).state
        state = m.decide(state, m.Ready("b", f"b{i}", m.JOINING, float(i)), m.Policy()).state
    assert state.last_number > 100
    d = state_doc.state_to_doc(state)
    assert len(d["history"]) == state_doc.DOC_HISTORY_LIMIT
    back = state_doc.state_from_doc(d, now=123.0)
    assert back.last_number == state.last_number and back.epoch == state.epoch
    assert {k: (v.incarnation, v.role, v.in_epoch) for k, v in back.members.items()} == \
        {x.replica_id: (x.incarnation, x.role, True) for x in state.epoch.members}  # type: ignore[union-attr]
    assert all(v.registered_at == 123.0 for v in back.members.values())
    assert [(e.number, e.replica_ids(), e.reason, e.created_at) for e in back.history] == \
        [(e.number, e.replica_ids(), e.reason, e.created_at) for e in state.history[-state_doc.DOC_HISTORY_LIMIT:]]
    # The document is bounded: the current epoch in full, then replica ids of a bounded history.
    assert len(json.dumps(d)) < 4096
    # And through a store (JSON).
    s = InMemoryStore()
    s.save(JOB, 0, d)
    assert state_doc.state_from_doc(s.load(JOB), now=123.0) == back  # type: ignore[arg-type]


def test_state_document_size_does_not_grow_with_history() -> None:
    members = tuple(m.EpochMember(f"replica-{i:04d}", f"inc-{i}", m.ACTIVE, 1, m.Endpoints()) for i in range(1000))

    def doc_size(epochs: int) -> int:
        history = tuple(m.Epoch(n, members, float(n), "r") for n in range(1, epochs + 1))
        state = m.State(epoch=history[-1], last_number=epochs, history=history[-HISTORY_LIMIT:])
        return len(json.dumps(state_doc.state_to_doc(state)))

    bounded = doc_size(state_doc.DOC_HISTORY_LIMIT)
    assert doc_size(HISTORY_LIMIT) < bounded + 100  # only the digits of the numbers differ
    assert doc_size(HISTORY_LIMIT + 50) < bounded + 100


def test_the_end_of_the_job_is_durable_and_an_old_document_loads_as_not_finished() -> None:
    p = m.Policy()
    state = m.State()
    for rid in ("a", "b"):
        state = m.decide(state, m.Register(rid, f"{rid}1", 1, m.Endpoints(), 0.0), p).state
    state = m.decide(state, m.Leave("a", "a1", "finished", 1.0, step=77), p).state
    assert state.finished_step == 77
    d = state_doc.state_to_doc(state)
    s = InMemoryStore()
    s.save(JOB, 0, d)
    back = state_doc.state_from_doc(s.load(JOB), now=2.0)
    assert back.finished_step == 77
    assert back.history[-1].events == state.history[-1].events  # the Finished event, too
    # Restored, the job is still finished: a registration is told so.
    assert m.decide(back, m.Register("c", "c1", 1, m.Endpoints(), 3.0), p).finished_step == 77
    # A document written before finished_step existed loads as not finished.
    old = {k: v for k, v in d.items() if k != "finished_step"}
    assert state_doc.state_from_doc(old, now=2.0).finished_step is None
    assert state_doc.state_to_doc(m.State())["finished_step"] is None


def test_incarnations_that_are_over_stay_over_across_a_restart() -> None:
    """Found by the simulator (seeds 159 and 2244, docs/chaos.md): the document keeps ``departed``, so a replica
    declared dead while it hung, back after a lighthouse restart on a durable store, is refused instead of
    registering again (or evicting its successor); and a member dropped while the min-replicas guard held the
    epoch is not restored as a member of that epoch."""
    p = m.Policy(min_replicas=2, expected_replicas=3)
    state = m.State()
    for rid in ("a", "b", "c"):
        state = m.decide(state, m.Register(rid, f"{rid}1", 1, m.Endpoints(), 0.0), p).state
    assert state.epoch is not None and len(state.epoch.members) == 3
    state = m.decide(state, m.Tick(10.0, {"a": 10.0, "b": 10.0, "c": 1.0}), p).state  # c silent: dead
    held = m.decide(state, m.Tick(20.0, {"a": 20.0, "b": 11.0}), p).state  # b too; the guard holds epoch 2
    assert held.epoch is state.epoch and state_doc.durable_change(state, held)  # no new epoch, yet stored
    assert not state_doc.durable_change(held, m.decide(held, m.Tick(20.5, {"a": 20.5}), p).state)
    state = held
    assert state.epoch is not None and state.epoch.replica_ids() == ("a", "b") and set(state.members) == {"a"}
    back = state_doc.state_from_doc(json.loads(json.dumps(state_doc.state_to_doc(state))), now=30.0)
    assert back.departed == {"b": ("b1",), "c": ("c1",)}
    assert set(back.members) == {"a"} and back.epoch == state.epoch  # b is over: not a member again
    for rid in ("b", "c"):
        out = m.decide(back, m.Register(rid, f"{rid}1", 1, m.Endpoints(), 31.0, claim=m.ACTIVE, last_epoch=2), p)
        assert out.rejection is not None and out.rejection.code == "FAILED_PRECONDITION", out.rejection
    # A document written before ``departed`` existed loads with none.
    old = {k: v for k, v in state_doc.state_to_doc(state).items() if k != "departed"}
    assert state_doc.state_from_doc(old, now=30.0).departed == {}


def test_10000_registrations_that_go_silent_leave_a_document_etcd_accepts() -> None:
    """Issue 41: every departed registration used to stay in ``departed`` for good, so 5,000 that went silent grew
    the document to 1.32 MB, and past etcd's 1.5 MiB request limit every save failed and membership stopped
    changing. The most recent ``DEPARTED_IDS_LIMIT`` ids are kept, in departure order, across a restart."""
    from lighthouse.incarnations import drop
    from lighthouse.model import DEPARTED_IDS_LIMIT, Member

    ep = m.Endpoints("10.0.0.1:29400", "10.0.0.1:29401", "")
    state = m.State()
    for batch in range(10):  # 10,000 registrations, each silent once registered: dropped as dead
        ids = [f"silent-{batch:02d}-{i:04d}-{'x' * 40}" for i in range(1000)]
        members = {rid: Member(rid, f"{rid}-incarnation-{'y' * 40}", 8, ep, m.JOINING, False, 0.0) for rid in ids}
        state = drop(m.State(members=members, departed=state.departed), ids)
    assert len(state.departed) == DEPARTED_IDS_LIMIT
    raw = json.dumps(state_doc.state_to_doc(state), sort_keys=True).encode()  # as the stores write it
    assert len(raw) < 1_500_000 * 0.8, len(raw)
    kept = list(state.departed)
    assert kept[0] == f"silent-07-0952-{'x' * 40}" and kept[-1] == f"silent-09-0999-{'x' * 40}"  # the newest
    back = state_doc.state_from_doc(json.loads(raw), now=1.0)
    assert list(back.departed) == kept  # the order survives the store's sorted keys
    legacy = {**state_doc.state_to_doc(state), "departed": {"a": ["a1"], "b": ["b1", "b2"]}}  # before the order
    assert state_doc.state_from_doc(legacy, now=1.0).departed == {"a": ("a1",), "b": ("b1", "b2")}


def test_the_jobs_layout_is_durable() -> None:
    """A lighthouse that takes over (or restarts on its store) refuses the same layouts as the one before."""
    state = dataclasses.replace(m.State(), layout="pp2xdp1")
    assert state_doc.durable_change(m.State(), state)
    assert state_doc.state_from_doc(state_doc.state_to_doc(state), now=0.0).layout == "pp2xdp1"
    assert state_doc.state_from_doc({**state_doc.state_to_doc(m.State()), "layout": None}, now=0.0).layout == ""
