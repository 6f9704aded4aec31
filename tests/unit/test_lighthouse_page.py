"""The lighthouse's page at ``/`` (lighthouse/page.py) as a pure function of the status document, and the
membership events it (and the metrics) show: their kinds, from the decision's structured events."""

from __future__ import annotations

import html.parser
import json
from typing import Any

from lighthouse import membership as m
from lighthouse.events import (
    DeathCause,
    Died,
    Finished,
    Left,
    ReadyToJoin,
    Registered,
    Restarted,
    TurnedActive,
    replica_kinds,
)
from lighthouse.page import render_page


def _status(**kw: Any) -> dict[str, Any]:
    doc = {"job": "default", "leader": True, "epoch": 4, "min_replicas": 1, "heartbeat_timeout_s": 3.0,
           "members": [{"replica_id": "r0", "incarnation": "a1", "role": "active", "in_epoch": True, "step": 12,
                        "last_heartbeat_age_s": 0.1},
                       {"replica_id": "r1", "incarnation": "b2", "role": "joining", "in_epoch": True, "step": 0,
                        "last_heartbeat_age_s": 0.2}],
           "history": [{"epoch": 1, "time": 1.7e9, "reason": "bootstrap", "members": ["r0", "r1"], "events": []},
                       {"epoch": 2, "time": 1.7e9 + 5, "reason": "replica r1 dead (no heartbeat for 3.01s)",
                        "members": ["r0"], "events": [{"replica_id": "r1", "kind": "failure"}]},
                       {"epoch": 3, "time": 1.7e9 + 9, "reason": "replica r1 ready to join", "members": ["r0", "r1"],
                        "events": [{"replica_id": "r1", "kind": "rejoin"}]}]}
    doc.update(kw)
    return doc


class _Collect(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self._in: dict[str, str | None] | None = None
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self._in = a
            self.scripts.append((a, ""))
        for key in ("src", "href"):
            if a.get(key):
                self.external.append(str(a[key]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)


def test_page_is_self_contained_and_embeds_the_status() -> None:
    doc = _status()
    page = render_page(doc)
    p = _Collect()
    p.feed(page)
    assert p.external == []  # no external assets: works on an isolated cluster
    embedded = [text for attrs, text in p.scripts if attrs.get("id") == "initial-status"]
    assert len(embedded) == 1 and json.loads(embedded[0]) == doc
    assert 'new URL("status"' in page and "fetch(url.href" in page  # refreshes itself from /status
    # Without JavaScript: the same data as tables.
    assert "<td>r1</td><td>joining</td>" in page and "replica r1 dead" in page


def test_page_shows_each_members_data_slot_and_the_spares() -> None:
    members = [{"replica_id": "r0", "role": "active", "in_epoch": True, "slot": 1, "step": 3},
               {"replica_id": "r1", "role": "active", "in_epoch": True, "slot": None, "step": 3},
               {"replica_id": "r2", "role": "joining", "in_epoch": False, "slot": None, "step": 0}]
    page = render_page(_status(members=members))
    assert "<th>slot</th>" in page and '"slot", "in epoch"' in page  # both tables have the column
    assert "<td>r0</td><td>active</td><td>1</td>" in page
    assert "<td>r1</td><td>active</td><td>spare</td>" in page  # in the data plane without a slot
    assert "<td>r2</td><td>joining</td><td>-</td>" in page


def test_page_names_the_data_slots_nobody_trains() -> None:
    static = render_page(_status(waiting_slots=[1, 3])).split("<script")[0]  # the table without JavaScript
    assert "data slots without an active holder: 1, 3" in static
    assert "without an active holder" not in render_page(_status(waiting_slots=[])).split("<script")[0]
    assert '"slots without a holder"' in render_page(_status())  # the live view's item


def test_page_data_cannot_break_out_of_the_script() -> None:
    evil = "</script><script>alert(1)</script><!--"
    doc = _status(history=[{"epoch": 1, "time": 1.7e9, "reason": f"replica r0 left: {evil}", "members": [],
                                  "events": [{"replica_id": evil, "kind": "leave"}]}])
    page = render_page(doc)
    assert evil not in page
    assert page.count("</script>") == 2  # the JSON island's and the renderer's, nothing injected
    p = _Collect()
    p.feed(page)
    embedded = [text for attrs, text in p.scripts if attrs.get("id") == "initial-status"]
    assert json.loads(embedded[0])["history"][0]["reason"].endswith(evil)  # intact, only escaped


def test_membership_events_have_the_kinds_the_page_and_the_metrics_show() -> None:
    assert replica_kinds(()) == []
    assert replica_kinds((Died("r-1", DeathCause.TIMEOUT, silent_s=3.01),
                          Died("r-2", DeathCause.HUNG, reported_epochs=3))) == [("r-1", "failure"), ("r-2", "failure")]
    assert replica_kinds((Restarted("r3", "ab"), Registered("r3", m.JOINING))) == [("r3", "failure"), ("r3", "join")]
    assert replica_kinds((ReadyToJoin("r3"),)) == [("r3", "rejoin")]
    assert replica_kinds((TurnedActive("r3"),)) == [("r3", "active")]
    assert replica_kinds((Left("r4", "done"),)) == [("r4", "leave")]


def test_the_decision_emits_the_events_the_page_shows() -> None:
    """What the decision says happened, through to the kinds: a death, a restart, a rejoin, turning active, a leave."""
    p = m.Policy(min_replicas=1, expected_replicas=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0,
                 confirm_age_s=0.5)
    ep = m.Endpoints()
    s = m.decide(m.State(), m.Register("a", "a1", 1, ep, 0.0), p).state
    s = m.decide(s, m.Register("b", "b1", 1, ep, 0.0), p).state
    out = m.decide(s, m.Tick(now=2.0, last_seen={"a": 1.9, "b": 0.0}), p)
    assert replica_kinds(out.state.epoch.events) == [("b", "failure")]  # type: ignore[union-attr]
    out = m.decide(out.state, m.Register("b", "b2", 1, ep, 2.0), p)
    assert replica_kinds(out.events) == [("b", "join")] and out.state.epoch.number == 2  # type: ignore[union-attr]
    out = m.decide(out.state, m.Ready("b", "b2", m.JOINING, 2.1), p)
    assert replica_kinds(out.state.epoch.events) == [("b", "rejoin")]  # type: ignore[union-attr]
    out = m.decide(out.state, m.Ready("b", "b2", m.ACTIVE, 2.2), p)
    assert replica_kinds(out.state.epoch.events) == [("b", "active")]  # type: ignore[union-attr]
    out = m.decide(out.state, m.Leave("b", "b2", "done", 2.3), p)
    assert replica_kinds(out.state.epoch.events) == [("b", "leave")]  # type: ignore[union-attr]
    assert out.state.epoch.reason == "replica b left: done"  # type: ignore[union-attr]


def test_page_shows_that_the_job_finished_and_a_finish_counts_as_a_leave() -> None:
    assert "job finished" not in render_page(_status(finished_step=None)).split("<script")[0]
    page = render_page(_status(finished_step=7))
    assert "job finished at step 7" in page.split("<script")[0]  # the page without JavaScript
    assert 'item("job finished at step", s.finished_step' in page  # the script's summary
    assert replica_kinds((Finished("r5", 7),)) == [("r5", "leave")]
