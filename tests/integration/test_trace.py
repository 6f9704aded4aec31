"""``fthsdp demo --trace`` on 3 replica groups x 2 ranks with a SIGKILL: the job's trace is a well-formed Chrome
trace-event document with one track per rank of every replica, every phase of a step on the survivors' tracks, and
the kill visible (the launcher's mark, the lighthouse's epoch that drops the replica, the killed ranks' spans ending
there)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from fthsdp.trace import chrome

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_trace_has_every_rank_and_the_kill(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "fthsdp", "--log-level", "WARNING", "demo", "--model", "tiny",
                           "--steps", "60", "--kill", "1@10", "--timeout", "240", "--trace", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "batches trained per data slot: [60, " in proc.stdout  # the end says what each slot trained
    assert "trained by: slot 0: replica 0 (60); slot 1: replica 1 (" in proc.stdout  # and by whom
    doc = json.loads(out.read_text())
    assert chrome.problems(doc) == []
    assert out.with_suffix(".png").stat().st_size > 10_000
    tracks = chrome.rank_tracks(doc)
    for r in range(3):
        assert {"rank 0", "rank 1"} <= set(tracks[f"replica-{r}"]), tracks
    events = doc["traceEvents"]
    kill = [e for e in events if e["ph"] == "i" and e.get("s") == "g" and e["name"] == "replica 1 killed"]
    assert len(kill) == 1, [e["name"] for e in events if e["ph"] == "i"]
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    first = [e for e in events if e["ph"] == "X" and e["pid"] == pids["replica-1"]
             and e["tid"] < chrome.TIDS_PER_INCARNATION]
    # The killed incarnation's steps end before the launcher saw its exit, and before the epoch that drops it (the
    # lighthouse may declare the death before the launcher notices the process gone).
    last = max(e["ts"] + e["dur"] for e in first)
    assert last <= kill[0]["ts"], (last, kill[0]["ts"])
    assert any(e.get("cat") == "epoch" and "replica-1 failure" in e["name"] and e["ts"] >= last for e in events)
    for survivor in ("replica-0", "replica-2"):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pids[survivor]]
        assert {"forward", "backward", "bucket 0", "post", "wait", "vote", "optimizer"} <= {e["name"] for e in spans}
        assert max(e["ts"] for e in spans) > kill[0]["ts"] + 1e6  # they trained on past the kill
        assert {e["args"]["step"] for e in spans if e["name"] == "optimizer"} >= set(range(20, 50))
