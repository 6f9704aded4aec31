"""The lighthouse's page for people (``GET /``): a pure function from the status document (``GET /status``) to one
self-contained HTML page (inline CSS and JS, no external assets, so it works on an isolated cluster).

The page shows the job's summary (epoch, leader, live replicas), the replicas with role, data slot (or "spare"), step
and heartbeat age, a timeline of the recent epochs as a grid (one row per replica, one column per epoch: active,
joining, absent, and the epochs where it failed or rejoined, from each history entry's structured ``events``), the
epochs with their events and reasons, and a link to the latest trace of the job when one was published (``fthsdp trace
--publish``; ``GET /trace.json``, which Perfetto and ``chrome://tracing`` open). A small inline script draws all of
that from the status document embedded in the page, then fetches ``/status`` every ``REFRESH_S`` seconds and redraws
(same origin: a browser that authenticated for ``/`` sends the same credentials). Every string from the document
reaches the DOM through ``textContent``, never as markup. Without JavaScript a plain table of the same data is shown."""

from __future__ import annotations

import html
import json
import time
from typing import Any

REFRESH_S = 2.0

def _json_for_script(doc: dict[str, Any]) -> str:
    """JSON that cannot end the <script> element it sits in."""
    return (json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _slot(member: dict[str, Any]) -> str:
    """The data slot a member trains; "spare" for one in the data plane without one, "-" for one outside it."""
    slot = member.get("slot")
    if slot is not None:
        return str(int(slot))
    return "spare" if member.get("in_epoch") else "-"


def _fallback(status: dict[str, Any]) -> str:
    """The same data as plain tables, for a browser without JavaScript."""
    rows = "".join(
        f"<tr><td>{html.escape(str(x['replica_id']))}</td><td>{html.escape(str(x['role']))}</td>"
        f"<td>{_slot(x)}</td><td>{'yes' if x.get('in_epoch') else 'no'}</td><td>{int(x.get('step', 0))}</td>"
        f"<td>{float(x.get('last_heartbeat_age_s', 0)):.2f}</td><td>{html.escape(str(x.get('digest') or '-'))}</td>"
        "</tr>" for x in status.get("members", []))
    hist = "".join(
        f"<tr><td>{int(e['epoch'])}</td><td>{time.strftime('%H:%M:%S', time.localtime(e['time']))}</td>"
        f"<td>{len(e.get('members', []))}</td><td>{html.escape(str(e.get('reason', '')))}</td></tr>"
        for e in reversed(status.get("history", [])))
    finished = status.get("finished_step")
    agreement = status.get("agreement")
    trace = status.get("trace")
    waiting = status.get("waiting_slots") or []
    slow = "; ".join(str(x.get("text", "")) for x in [*(status.get("stragglers") or []),
                                                       *(status.get("slow_links") or [])])
    return (f"<p>job {html.escape(str(status.get('job', '')))} · epoch {int(status.get('epoch', 0))}"
            + (f" · job finished at step {int(finished)}" if finished is not None else "")
            + (f" · state: {html.escape(str(agreement.get('text', '')))}" if agreement else "")
            + (f" · stragglers: {html.escape(slow)}" if slow else "")
            + (f" · data slots without an active holder: {', '.join(str(int(k)) for k in waiting)}" if waiting else "")
            + (f' · <a href="trace.json">latest trace</a> ({int(trace.get("events", 0))} events)' if trace else "")
            + "</p>"
            "<table><tr><th>replica</th><th>role</th><th>slot</th><th>in epoch</th><th>step</th>"
            "<th>heartbeat age (s)</th><th>state digest</th></tr>"
            f"{rows}</table><table><tr><th>epoch</th><th>time</th><th>members</th><th>reason</th></tr>{hist}</table>")


_STYLE = """
:root{--active:#2e7d32;--joining:#f9a825;--failure:#c62828;--rejoin:#1565c0;--absent:#eceff1;--ink:#212121}
body{font-family:system-ui,sans-serif;margin:24px;color:var(--ink);background:#fff}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:24px 0 8px}
.summary span{display:inline-block;margin-right:18px}.summary b{font-size:18px}
.stale{color:var(--failure)}.muted{color:#757575;font-size:12px}
.digest{font-family:monospace;font-size:12px}.digest.differ{color:var(--failure);font-weight:bold}
.pace.slow{color:var(--failure);font-weight:bold}
table{border-collapse:collapse}td,th{border:1px solid #cfd8dc;padding:3px 9px;text-align:left;font-size:13px}
th{background:#eceff1}
.role{display:inline-block;padding:1px 8px;border-radius:9px;color:#fff;font-size:12px}
.role.active{background:var(--active)}.role.joining{background:var(--joining);color:#000}
.grid td.cell{width:22px;height:18px;padding:0;border:1px solid #fff}
.cell.active{background:var(--active)}.cell.joining{background:var(--joining)}.cell.absent{background:var(--absent)}
.cell.failure{background:var(--failure)}.cell.rejoin{background:var(--rejoin)}
.grid th.ep{font-size:10px;padding:0 2px;text-align:center;font-weight:normal}
.kind{display:inline-block;padding:0 6px;margin-right:4px;border-radius:4px;color:#fff;font-size:11px}
.kind.failure{background:var(--failure)}.kind.rejoin{background:var(--rejoin)}.kind.active{background:var(--active)}
.kind.leave{background:#6d4c41}.kind.join{background:#546e7a}.kind.other{background:#9e9e9e}
.legend span{margin-right:12px;font-size:12px}.legend i{display:inline-block;width:12px;height:12px;
margin-right:4px;vertical-align:-2px}
"""

# The renderer: pure DOM building with textContent (no innerHTML of data). An epoch's events come from its history
# entry: [{"replica_id", "kind"}], kind one of failure, rejoin, active, leave, join (lighthouse/events.py).
_SCRIPT = r"""
(function () {
  "use strict";
  var REFRESH_MS = %(refresh_ms)d;
  function events(e) {
    return (e.events || []).map(function (x) { return [x.replica_id, x.kind]; });
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in (attrs || {})) { e.setAttribute(k, attrs[k]); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function row(cells, header) {
    var tr = el("tr");
    cells.forEach(function (c) {
      var td = el(header ? "th" : "td");
      if (c instanceof Node) { td.appendChild(c); } else { td.textContent = String(c); }
      tr.appendChild(td);
    });
    return tr;
  }
  function hhmmss(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }
  function summary(s, source) {
    var p = el("p", {"class": "summary", "id": "summary"});
    function item(label, value, id) {
      var sp = el("span");
      sp.appendChild(document.createTextNode(label + " "));
      sp.appendChild(el("b", id ? {"id": id} : {}, value));
      p.appendChild(sp);
    }
    item("job", s.job, "job");
    item("epoch", s.epoch, "epoch");
    item("live replicas", (s.members || []).length, "live");
    item("min replicas", s.min_replicas);
    if (s.finished_step !== null && s.finished_step !== undefined) {
      item("job finished at step", s.finished_step, "finished");
    }
    var a = s.agreement;
    item("state", a ? (a.agree ? "agree" : "DIFFER (" + a.differ.join(", ") + ")") + " at step " + a.step
                    : "not compared yet", "agreement");
    var slow = s.stragglers || [];
    item("stragglers", slow.length ? slow.map(function (x) { return x.replica_id + " " + x.slowdown + "x"; })
                                            .join(", ") : "none", "stragglers");
    var links = s.slow_links || [];
    item("slow links", links.length ? links.map(function (x) { return x.replica_id + " rank " + x.rank; })
                                           .join(", ") : "none", "slow-links");
    var waiting = s.waiting_slots || [];  // their batches wait until a holder or a spare takes them
    item("slots without a holder", waiting.length ? waiting.join(", ") : "none", "waiting-slots");
    item("leader", s.leader ? "this lighthouse"
                            : ("no" + (s.leader_address ? " (leader: " + s.leader_address + ")" : "")), "leader");
    if (s.trace) {  // the latest published trace (fthsdp trace --publish): Perfetto or chrome://tracing opens it
      var tr = el("span");
      tr.appendChild(document.createTextNode("latest trace "));
      tr.appendChild(el("a", {"href": "trace.json", "id": "trace", "download": "trace.json"},
                        s.trace.events + " events, published " + hhmmss(s.trace.published_unix)));
      p.appendChild(tr);
    }
    var upd = el("span", {"class": "muted", "id": "updated"},
                 (source === "live" ? "updated " : "snapshot of ") + new Date().toTimeString().slice(0, 8));
    p.appendChild(upd);
    return p;
  }
  function members(s) {
    var t = el("table", {"id": "members"});
    t.appendChild(row(["replica", "role", "slot", "in epoch", "step", "heartbeat age (s)", "incarnation",
                       "compute / wait (s)", "state digest (step)"], true));
    var slowIds = (s.stragglers || []).map(function (x) { return x.replica_id; });
    var differ = (s.agreement && s.agreement.differ) || [];
    (s.members || []).forEach(function (x) {
      var dg = el("span", {"class": "digest" + (differ.indexOf(x.replica_id) >= 0 ? " differ" : "")},
                  x.digest ? x.digest + " (" + x.digest_step + ")" : "-");
      var pace = el("span", {"class": "pace" + (slowIds.indexOf(x.replica_id) >= 0 ? " slow" : "")},
                    x.pace ? Number(x.pace.compute_s).toFixed(3) + " / " + Number(x.pace.wait_s).toFixed(3) : "-");
      var slot = x.slot !== null && x.slot !== undefined ? String(x.slot) : (x.in_epoch ? "spare" : "-");
      var tr = row([x.replica_id, el("span", {"class": "role " + x.role}, x.role), slot, x.in_epoch ? "yes" : "no",
                    x.step, Number(x.last_heartbeat_age_s).toFixed(2), String(x.incarnation || "").slice(0, 12), pace,
                    dg]);
      tr.setAttribute("data-replica", x.replica_id);
      tr.setAttribute("data-role", x.role);
      if (x.last_heartbeat_age_s > (s.heartbeat_timeout_s || 1e9) / 2) { tr.className = "stale"; }
      t.appendChild(tr);
    });
    return t;
  }
  function timeline(s) {
    var hist = s.history || [];
    var ids = {};
    hist.forEach(function (e) { (e.members || []).forEach(function (r) { ids[r] = 1; });
                                events(e).forEach(function (ev) { ids[ev[0]] = 1; }); });
    (s.members || []).forEach(function (x) { ids[x.replica_id] = 1; });
    var t = el("table", {"class": "grid", "id": "timeline"});
    var head = [el("span", {}, "replica \u2193 / epoch \u2192")];
    var tr = row(head, true);
    hist.forEach(function (e) { tr.appendChild(el("th", {"class": "ep", "title": hhmmss(e.time)}, e.epoch)); });
    t.appendChild(tr);
    Object.keys(ids).sort().forEach(function (rid) {
      var r = el("tr", {"data-replica": rid});
      r.appendChild(el("td", {}, rid));
      hist.forEach(function (e) {
        var inEpoch = (e.members || []).indexOf(rid) >= 0;
        var kind = inEpoch ? "active" : "absent";
        events(e).forEach(function (ev) {
          if (ev[0] === rid && (ev[1] === "failure" || ev[1] === "rejoin")) { kind = ev[1]; }
        });
        var td = el("td", {"class": "cell " + kind, "data-epoch": e.epoch, "data-kind": kind,
                           "title": "epoch " + e.epoch + ": " + kind + " \u2014 " + e.reason});
        r.appendChild(td);
      });
      t.appendChild(r);
    });
    return t;
  }
  function epochs(s) {
    var t = el("table", {"id": "history"});
    t.appendChild(row(["epoch", "time", "members", "events", "reason"], true));
    (s.history || []).slice().reverse().forEach(function (e) {
      var evs = el("span");
      var seen = events(e);
      if (!seen.length) {
        evs.appendChild(el("span", {"class": "kind other"}, e.epoch === 1 ? "bootstrap" : "re-formed"));
      }
      seen.forEach(function (ev) { evs.appendChild(el("span", {"class": "kind " + ev[1]}, ev[1] + " " + ev[0])); });
      var tr = row([e.epoch, hhmmss(e.time), (e.members || []).length, evs, e.reason]);
      tr.setAttribute("data-epoch", e.epoch);
      t.appendChild(tr);
    });
    return t;
  }
  function legend() {
    var p = el("p", {"class": "legend"});
    [["active", "member of the epoch"], ["rejoin", "rejoined (joining)"], ["failure", "failed"],
     ["absent", "not a member"]].forEach(function (k) {
      var sp = el("span"); var i = el("i", {"class": "cell " + k[0]});
      i.style.background = "var(--" + k[0] + ")"; sp.appendChild(i); sp.appendChild(document.createTextNode(k[1]));
      p.appendChild(sp);
    });
    return p;
  }
  function render(s, source) {
    var root = document.getElementById("app");
    var next = el("div", {"id": "app", "data-rendered": "js", "data-source": source, "data-epoch": s.epoch});
    next.appendChild(el("h1", {}, "fthsdp lighthouse"));
    next.appendChild(summary(s, source));
    next.appendChild(el("h2", {}, "Replicas"));
    next.appendChild(members(s));
    next.appendChild(el("h2", {}, "Timeline (last " + (s.history || []).length + " epochs)"));
    next.appendChild(legend());
    next.appendChild(timeline(s));
    next.appendChild(el("h2", {}, "Epochs"));
    next.appendChild(epochs(s));
    root.parentNode.replaceChild(next, root);
    document.title = "fthsdp lighthouse: " + s.job + " (epoch " + s.epoch + ")";
  }
  function refresh() {
    var ctl = window.AbortController ? new AbortController() : null;
    var timer = setTimeout(function () { if (ctl) { ctl.abort(); } }, REFRESH_MS * 2);
    // /status next to this page, without credentials in the URL (fetch refuses those; a browser that
    // authenticated for the page still sends them for the same origin).
    var url = new URL("status", window.location.href);
    url.username = ""; url.password = ""; url.search = ""; url.hash = "";
    fetch(url.href, {cache: "no-store", credentials: "same-origin", signal: ctl ? ctl.signal : undefined})
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
      .then(function (s) { render(s, "live"); })
      .catch(function (err) {
        var u = document.getElementById("updated");
        if (u) { u.textContent = "lighthouse unreachable: " + err.message; u.className = "stale"; }
      })
      .then(function () { clearTimeout(timer); setTimeout(refresh, REFRESH_MS); });
  }
  render(JSON.parse(document.getElementById("initial-status").textContent), "embedded");
  refresh();
})();
"""


def render_page(status: dict[str, Any]) -> str:
    """The HTML of ``GET /`` for the status document ``status`` (the JSON of ``GET /status``)."""
    job = html.escape(str(status.get("job", "")))
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>fthsdp lighthouse: {job} (epoch {int(status.get('epoch', 0))})</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"<div id=\"app\" data-rendered=\"server\"><h1>fthsdp lighthouse</h1>"
        f"<noscript>{_fallback(status)}</noscript></div>"
        f"<script type=\"application/json\" id=\"initial-status\">{_json_for_script(status)}</script>"
        f"<script>{_SCRIPT % {'refresh_ms': int(REFRESH_S * 1000)}}</script>"
        "</body></html>")
