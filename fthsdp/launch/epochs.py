"""The lighthouse's epoch history in a run's report: its ``/status`` rows as report events (``t``, ``event:
"epoch"``), and back (the trace of ``fthsdp demo --trace`` takes the run's final history)."""

from __future__ import annotations

from typing import Any


def epoch_events(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lighthouse's epoch history (``/status``) as report events (``epoch_history`` gives it back)."""
    return [{"t": h["time"], "event": "epoch", "epoch": h["epoch"], "reason": h["reason"], "members": h["members"],
             "events": h.get("events", [])} for h in history]


def epoch_history(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's final epoch history as ``/status`` lists it, from the report's epoch events."""
    return [{"time": e["t"], "epoch": e["epoch"], "reason": e["reason"], "members": e["members"],
             "events": e["events"]} for e in report["events"] if e["event"] == "epoch"]
