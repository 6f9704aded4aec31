"""The lighthouse's metrics and status view count membership events from the structured events, never from the
reason text: a burst of deaths whose reason is clipped is still counted whole."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from lighthouse import membership as m
from lighthouse.events import REASON_LIMIT
from lighthouse.metrics import LighthouseMetrics
from lighthouse.server import status

N = 300  # deaths in one burst: their reason text is far over REASON_LIMIT


def _burst() -> m.State:
    """Epoch 1 of N + 1 replicas, then epoch 2 after all but r0000 went silent at once."""
    policy = m.Policy(min_replicas=1, expected_replicas=N + 1, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0,
                      confirm_age_s=0.5)
    state = m.State()
    for i in range(N + 1):
        state = m.decide(state, m.Register(f"r{i:04d}", f"i{i}", 1, m.Endpoints(), 0.0), policy).state
    assert state.epoch is not None and state.epoch.number == 1
    state = m.decide(state, m.Tick(now=5.0, last_seen={"r0000": 4.9}), policy).state
    assert state.epoch is not None and state.epoch.number == 2
    return state


def _counted(metrics: LighthouseMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "fthsdp_lighthouse_membership_events_total" and s.labels["job"] == "job"}


def test_a_burst_of_deaths_is_counted_whole_though_the_reason_is_clipped() -> None:
    state = _burst()
    epoch = state.epoch
    assert epoch is not None
    assert len(epoch.reason) <= REASON_LIMIT + 40 and "more)" in epoch.reason  # the text is clipped...
    assert len(epoch.events) == N  # ...the events are not
    metrics = LighthouseMetrics()
    metrics.observe_epoch("job", state)
    assert _counted(metrics) == {"failure": N}


def test_the_bootstrap_epoch_counts_no_events() -> None:
    state = _burst()
    first = state.history[0]
    metrics = LighthouseMetrics()
    metrics.observe_epoch("job", m.State(members=state.members, epoch=first, last_number=1, history=(first,)))
    assert _counted(metrics) == {}


def test_status_view_lists_every_event_for_grpc_and_http_alike() -> None:
    state = _burst()
    view = status.build("job", state, last_seen={"r0000": 4.9}, steps={"r0000": 7}, rendezvous="",
                        policy=m.Policy(), leader=status.Leader(True, "lh:1", "lh:1"), now=5.0,
                        digests={"r0000": ("i0", 5, "00ff00ff00ff00ff"), "gone": ("i9", 5, "00ff00ff00ff00ff")})
    doc = status.to_json(view)
    assert doc["agreement"] is None  # one member's digest (a non-member's is not counted): nothing to compare
    stale = status.build("job", state, last_seen={}, steps={}, rendezvous="", policy=m.Policy(),
                         leader=status.Leader(True, "lh:1", "lh:1"), now=5.0, digests={"r0000": ("i-old", 5, "aa")})
    assert stale.members[0].digest == ""  # an earlier incarnation's digest (before a restart) is not shown
    assert [h["epoch"] for h in doc["history"]] == [1, 2]
    assert doc["history"][0]["events"] == [{"replica_id": f"r{N:04d}", "kind": "join"}]  # the last to register
    assert doc["history"][1]["events"] == [{"replica_id": f"r{i:04d}", "kind": "failure"} for i in range(1, N + 1)]
    assert doc["members"] == [{"replica_id": "r0000", "incarnation": "i0", "role": "active", "in_epoch": True,
                               "slot": None, "catchup": "", "last_heartbeat_age_s": 0.1, "step": 7, "digest_step": 5,
                               "digest": "00ff00ff00ff00ff", "pace": None}]
    from lighthouse.v1 import lighthouse_pb2 as pb

    answer = status.to_pb(view, pb.Epoch(job_id="job", number=2))
    assert [(h.epoch, h.reason, list(h.members), [(x.replica_id, x.kind) for x in h.events])
            for h in answer.history] == \
        [(h["epoch"], h["reason"], h["members"], [(x["replica_id"], x["kind"]) for x in h["events"]])
         for h in doc["history"]]
    assert [(x.replica_id, x.step, x.in_epoch) for x in answer.members] == [("r0000", 7, True)] and answer.leader
    assert [(x.digest_step, x.digest) for x in answer.members] == [(5, "00ff00ff00ff00ff")] and answer.agreement == ""


def test_agreement_compares_the_newest_step_two_members_digested() -> None:
    assert status.agreement({}) is None and status.agreement({"a": (10, "x1")}) is None
    assert status.agreement({"a": (10, "x1"), "b": (20, "x2")}) is None  # a digest apart: not compared
    same = status.agreement({"a": (20, "d1"), "b": (20, "d1"), "c": (10, "d0")})
    assert same is not None and same.agree and same.step == 20 and same.differ == ()
    assert same.text() == "agree at step 20 (2 replicas)"
    odd = status.agreement({"a": (30, "d1"), "b": (30, "d9"), "c": (30, "d1"), "d": (20, "d1")})
    assert odd is not None and not odd.agree and odd.differ == ("b",) and "differ at step 30" in odd.text()
    split = status.agreement({"a": (30, "d1"), "b": (30, "d9")})
    assert split is not None and split.differ == ("a", "b")  # no majority: nobody can tell which is right
