"""A job's timeline as a Chrome trace-event document (the JSON Perfetto and ``chrome://tracing`` open): pure, from the
ranks' tracks (``fthsdp.trace.pull``) and the lighthouse's epoch history.

One process per replica (``replica-1``), one thread per rank incarnation (``rank 0``; a restarted replica's ranks are
new threads, ``rank 0, incarnation 2``), a complete event (``ph: X``) per phase of a step, an instant (``ph: i``) per
mark; on a GPU, a rank's phases as its device ran them (a span's ``device_t0`` and ``device_ms``,
``fthsdp.runtime.device_clock``) on a thread of their own under it (``rank 0, device``); every epoch (with what
happened: a death, a join, an ejection) and every launcher event (a kill) is a global instant, a line across every
track. Times in microseconds from the earliest event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fthsdp.trace.pull import Track

PHASES = ("X", "i", "M")
LIGHTHOUSE_PID = 0
TIDS_PER_INCARNATION = 1 << 20
"""A rank's thread id is ``incarnation index × this + rank`` (replicas of up to half a million ranks stay apart)."""
DEVICE_TID = 1 << 19
"""Added to a rank's thread id: the thread of its device's spans."""


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 1)


def build(tracks: Iterable[Track], history: Sequence[dict[str, Any]] = (),
          launcher: Sequence[dict[str, Any]] = (), job: str = "") -> dict[str, Any]:
    """The trace of ``tracks``, with the lighthouse's ``history`` (``/status``'s: epoch, time, reason, events) and
    the launcher's events (``{"t", "name"}``) as global marks."""
    tracks = [t for t in tracks if t.events]
    times = [e[6] for t in tracks for e in t.events.values()] + [float(h["time"]) for h in history] + \
        [float(x["t"]) for x in launcher]
    t0 = min(times) if times else 0.0
    replicas = sorted({t.replica for t in tracks} | {m for h in history for m in h.get("members", ())})
    pid = {r: n + 1 for n, r in enumerate(replicas)}
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": LIGHTHOUSE_PID, "tid": 0, "args": {"name": "lighthouse"}},
        {"name": "process_sort_index", "ph": "M", "pid": LIGHTHOUSE_PID, "tid": 0, "args": {"sort_index": 0}}]
    for r in replicas:
        out.append({"name": "process_name", "ph": "M", "pid": pid[r], "tid": 0, "args": {"name": r}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid[r], "tid": 0, "args": {"sort_index": pid[r]}})
    incarnations: dict[str, list[str]] = {}
    for t in sorted(tracks, key=lambda t: min(e[6] for e in t.events.values())):
        known = incarnations.setdefault(t.replica, [])
        if t.incarnation not in known:
            known.append(t.incarnation)
    dropped = 0
    for t in sorted(tracks, key=lambda t: (pid[t.replica], incarnations[t.replica].index(t.incarnation), t.rank)):
        n = incarnations[t.replica].index(t.incarnation)
        tid = n * TIDS_PER_INCARNATION + t.rank
        label = f"rank {t.rank}" + (f", incarnation {n + 1}" if n else "")
        out.append({"name": "thread_name", "ph": "M", "pid": pid[t.replica], "tid": tid, "args": {"name": label}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid[t.replica], "tid": tid,
                    "args": {"sort_index": tid}})
        dropped += t.dropped
        device_named = False
        for seq in sorted(t.events):
            _, ph, name, cat, step, epoch, a, b, args = t.events[seq]
            ev = {"name": name, "cat": cat, "ph": ph, "ts": _us(a, t0), "pid": pid[t.replica], "tid": tid,
                  "args": {"step": step, "epoch": epoch, **(args or {})}}
            if ph == "X":
                ev["dur"] = round(max(0.0, b - a) * 1e6, 1)
            else:
                ev["s"] = "t"
            out.append(ev)
            if ph == "X" and args and "device_t0" in args:
                if not device_named:
                    device_named = True
                    out.append({"name": "thread_name", "ph": "M", "pid": pid[t.replica], "tid": tid + DEVICE_TID,
                                "args": {"name": f"{label}, device"}})
                    out.append({"name": "thread_sort_index", "ph": "M", "pid": pid[t.replica],
                                "tid": tid + DEVICE_TID, "args": {"sort_index": tid + DEVICE_TID}})
                out.append({"name": name, "cat": cat, "ph": "X", "ts": _us(float(args["device_t0"]), t0),
                            "dur": round(float(args["device_ms"]) * 1e3, 1), "pid": pid[t.replica],
                            "tid": tid + DEVICE_TID, "args": {"step": step, "epoch": epoch}})
    for h in history:
        what = ", ".join(f"{e['replica_id']} {e['kind']}" for e in h.get("events", ()))
        out.append({"name": f"epoch {h['epoch']}" + (f": {what}" if what else ""), "cat": "epoch", "ph": "i",
                    "s": "g", "ts": _us(float(h["time"]), t0), "pid": LIGHTHOUSE_PID, "tid": 0,
                    "args": {"reason": str(h.get("reason", ""))[:300], "members": list(h.get("members", ()))}})
    for x in launcher:
        out.append({"name": str(x["name"]), "cat": "launcher", "ph": "i", "s": "g", "ts": _us(float(x["t"]), t0),
                    "pid": LIGHTHOUSE_PID, "tid": 0, "args": {}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"job": job, "t0_unix": t0, "ranks": len(tracks), "dropped_events": dropped}}


def problems(doc: Any) -> list[str]:
    """What makes ``doc`` not a Chrome trace-event document (JSON object format) as this module writes it: empty
    when it is one."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    out = []
    for n, e in enumerate(doc["traceEvents"]):
        where = f"event {n}"
        if not isinstance(e, dict):
            out.append(f"{where}: not an object")
            continue
        if not isinstance(e.get("name"), str) or e.get("ph") not in PHASES:
            out.append(f"{where}: needs a name and a ph in {PHASES}")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            out.append(f"{where}: pid and tid must be integers")
        if e.get("ph") == "M":
            if not isinstance(e.get("args"), dict) or not e["args"]:
                out.append(f"{where}: a metadata event needs args")
            continue
        if not isinstance(e.get("ts"), (int, float)) or e["ts"] < 0:
            out.append(f"{where}: ts must be a number >= 0 (microseconds)")
        if e.get("ph") == "X" and (not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0):
            out.append(f"{where}: a complete event needs dur >= 0")
        if e.get("ph") == "i" and e.get("s") not in ("g", "p", "t"):
            out.append(f"{where}: an instant's scope s must be g, p or t")
        if "args" in e and not isinstance(e["args"], dict):
            out.append(f"{where}: args must be an object")
    return out


def names(doc: dict[str, Any]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    """The processes' names (by pid) and the threads' (by pid and tid), from the metadata events."""
    events = doc["traceEvents"]
    return ({e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"},
            {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"})


def rank_tracks(doc: dict[str, Any]) -> dict[str, list[str]]:
    """Per replica (process name), its ranks' tracks' names (thread names) that hold at least one span (not their
    devices' tracks)."""
    procs, threads = names(doc)
    busy = {(e["pid"], e["tid"]) for e in doc["traceEvents"]
            if e["ph"] == "X" and e["tid"] % TIDS_PER_INCARNATION < DEVICE_TID}
    out: dict[str, list[str]] = {}
    for key in sorted(busy):
        out.setdefault(procs[key[0]], []).append(threads[key])
    return out
