"""A rank's step timeline (``fthsdp.runtime.timeline``), read over the catch-up port (``fthsdp.trace.pull``) and
merged into a Chrome trace (``fthsdp.trace.chrome``): bounded, incremental, authenticated, well-formed."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
import torch

from fthsdp.catchup import auth
from fthsdp.catchup.server import CatchupServer
from fthsdp.catchup.wire import Refused, TraceRequest
from fthsdp.runtime.config import ConfigError, RuntimeConfig
from fthsdp.runtime.timeline import Timeline
from fthsdp.trace import chrome
from fthsdp.trace.pull import Collector, Track, members_of, read_rank

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"


def test_spans_and_marks_read_in_wall_clock_in_order() -> None:
    tl = Timeline(epoch=lambda: 7)
    before = time.time()
    t0 = time.perf_counter()
    tl.span("forward", "compute", 3, t0, t0 + 0.5, micro=1)
    tl.mark("role active", 3)
    with tl.timed("vote", "vote", 3):
        pass
    doc = tl.read()
    assert doc["dropped"] == 0 and [e[0] for e in doc["events"]] == [1, 2, 3]
    seq, ph, name, cat, step, epoch, a, b, args = doc["events"][0]
    assert (ph, name, cat, step, epoch, args) == ("X", "forward", "compute", 3, 7, {"micro": 1})
    assert before - 0.01 <= a <= time.time() and b == pytest.approx(a + 0.5, abs=1e-5)
    assert doc["events"][1][1] == "i" and doc["events"][1][6] == doc["events"][1][7]
    assert [e[2] for e in tl.read(since=2)["events"]] == ["vote"]
    json.dumps(doc)  # what the catch-up port sends


def test_the_ring_is_bounded_and_says_what_it_dropped() -> None:
    tl = Timeline(capacity=4)
    for n in range(10):
        tl.mark(f"m{n}", n)
    doc = tl.read()
    assert [e[2] for e in doc["events"]] == ["m6", "m7", "m8", "m9"] and doc["dropped"] == 6
    assert tl.read(since=7)["dropped"] == 0 and [e[0] for e in tl.read(since=7)["events"]] == [8, 9, 10]
    assert [e[0] for e in tl.read(limit=2)["events"]] == [9, 10]
    with pytest.raises(ValueError):
        Timeline(capacity=0)


def test_a_disabled_timeline_records_nothing_and_a_span_is_kept_when_its_block_raises() -> None:
    off = Timeline(enabled=False)
    off.mark("x", 0)
    off.span("y", "compute", 0, 1.0, 2.0)
    assert off.read()["events"] == []
    tl = Timeline()
    with pytest.raises(RuntimeError), tl.timed("optimizer", "optimizer", 1):
        raise RuntimeError("boom")
    assert [e[2] for e in tl.read()["events"]] == ["optimizer"]


def test_the_setting_is_read_and_checked() -> None:
    base = {"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "0", "FTHSDP_NUM_REPLICAS": "1"}
    assert RuntimeConfig.from_env(base).timeline_events == 4096
    assert RuntimeConfig.from_env({**base, "FTHSDP_TIMELINE": "0"}).timeline_events == 0
    with pytest.raises(ConfigError, match="FTHSDP_TIMELINE"):
        RuntimeConfig.from_env({**base, "FTHSDP_TIMELINE": "-1"})


def _server(token: str = TOKEN, rank: int = 0) -> tuple[CatchupServer, Timeline]:
    srv = CatchupServer(job="job", replica_id="replica-1", rank=rank, world_size=2, token=token,
                        snapshot=lambda: [("w", torch.zeros(1))], epoch=lambda: None)
    tl = Timeline()
    srv.incarnation, srv.timeline = "inc-a", tl.read
    return srv, tl


def test_a_rank_timeline_is_read_over_the_catchup_port_with_the_token_only() -> None:
    srv, tl = _server()
    try:
        tl.mark("role active", 0)
        tl.span("backward", "compute", 0, time.perf_counter(), time.perf_counter() + 0.1)
        got = read_rank(srv.address, "job", TOKEN)
        assert (got.replica, got.incarnation, got.rank) == ("replica-1", "inc-a", 0)
        assert [e[2] for e in got.timeline["events"]] == ["role active", "backward"]
        assert abs(got.offset_s) < 1.0  # one host, one clock
        assert [e[2] for e in read_rank(srv.address, "job", TOKEN, since=1).timeline["events"]] == ["backward"]
        with pytest.raises(Refused, match="unauthenticated"):
            read_rank(srv.address, "job", "another-token")
        with pytest.raises(Refused, match="unauthenticated"):
            read_rank(srv.address, "job", "")
        with pytest.raises(Refused, match="wrong_job"):
            read_rank(srv.address, "other-job", TOKEN)
        srv.timeline = None
        with pytest.raises(Refused, match="unavailable"):
            read_rank(srv.address, "job", TOKEN)
    finally:
        srv.close(drain_s=0)


def test_a_proof_is_bound_to_its_nonce_job_and_position() -> None:
    req = TraceRequest("job", 5)
    proof = auth.trace_proof(TOKEN, "n" * 64, req)
    assert auth.verify_trace(TOKEN, "n" * 64, TraceRequest("job", 5, proof))
    for nonce, other in (("m" * 64, TraceRequest("job", 5, proof)), ("n" * 64, TraceRequest("job2", 5, proof)),
                         ("n" * 64, TraceRequest("job", 6, proof))):
        assert not auth.verify_trace(TOKEN, nonce, other)
    assert not auth.verify_trace(TOKEN, "n" * 64, TraceRequest("job\0", 5, proof))


def test_the_collector_reads_every_rank_once_and_then_only_what_is_new() -> None:
    (s0, t0), (s1, t1) = _server(rank=0), _server(rank=1)
    try:
        s0.directory = s1.directory = [s0.address, s1.address]
        t0.mark("a", 0)
        t1.mark("b", 0)
        c = Collector("job", TOKEN)
        assert c.pull([("replica-1", "inc-a", s0.address), ("replica-2", "inc-b", "")]) == 2 and not c.errors
        t0.mark("c", 1)
        assert c.pull([("replica-1", "inc-a", s0.address)]) == 2
        tracks = {k[2]: [e[2] for _, e in sorted(v.events.items())] for k, v in c.tracks.items()}
        assert tracks == {0: ["a", "c"], 1: ["b"]}
        assert c.pull([("replica-1", "inc-a", "127.0.0.1:1")]) == 0 and c.errors  # a dead rank: noted, no raise
    finally:
        s0.close(drain_s=0)
        s1.close(drain_s=0)


def _track(replica: str, inc: str, rank: int, t: float) -> Track:
    tr = Track(replica, inc, rank)
    tr.events = {1: [1, "X", "forward", "compute", 0, 1, t, t + 0.2, {}],
                 2: [2, "X", "bucket 0", "exchange", 0, 1, t + 0.1, t + 0.3, {"failed": False}],
                 3: [3, "i", "role active", "mark", 0, 1, t, t, {}]}
    return tr


def test_the_chrome_trace_has_a_track_per_rank_incarnation_and_global_marks() -> None:
    tracks = [_track("replica-0", "a", 0, 100.0), _track("replica-0", "a", 1, 100.0),
              _track("replica-1", "b", 0, 100.0), _track("replica-1", "c", 0, 105.0)]
    history = [{"epoch": 2, "time": 104.0, "reason": "replica replica-1 dead", "members": ["replica-0"],
                "events": [{"replica_id": "replica-1", "kind": "failure"}]}]
    doc = chrome.build(tracks, history, [{"t": 103.5, "name": "replica 1 killed"}], job="job")
    assert chrome.problems(doc) == []
    assert chrome.rank_tracks(doc) == {"replica-0": ["rank 0", "rank 1"],
                                       "replica-1": ["rank 0", "rank 0, incarnation 2"]}
    wide = chrome.build([_track("replica-0", "a", 1000, 100.0), _track("replica-0", "b", 0, 101.0)])
    assert chrome.rank_tracks(wide) == {"replica-0": ["rank 1000", "rank 0, incarnation 2"]}  # thread ids apart
    marks = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "i" and e["s"] == "g"}
    assert marks["replica 1 killed"]["ts"] == pytest.approx(3.5e6) and "epoch 2: replica-1 failure" in marks
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0 and all(e["dur"] == pytest.approx(2e5) for e in spans)
    json.loads(json.dumps(doc))


@pytest.mark.parametrize("bad", [
    [], {"traceEvents": {}}, {"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0}]},
    {"traceEvents": [{"ph": "i", "name": "a", "pid": 1, "tid": 1, "ts": 0, "s": "x"}]},
    {"traceEvents": [{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 0}]},
    {"traceEvents": [{"ph": "X", "name": "a", "pid": "1", "tid": 1, "ts": -1, "dur": 1}]},
    {"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1}]},
])
def test_a_malformed_trace_is_named(bad: object) -> None:
    assert chrome.problems(bad)


def test_members_come_from_the_status_document() -> None:
    status = {"members": [{"replica_id": "replica-0", "incarnation": "i0", "catchup": "127.0.0.1:5"},
                          {"replica_id": "replica-1", "incarnation": "i1"}]}
    assert members_of(status) == [("replica-0", "i0", "127.0.0.1:5"), ("replica-1", "i1", "")]


def test_the_overhead_bench_measures_the_timeline_against_itself_off() -> None:
    from fthsdp.bench.overhead import bench_overhead, span_cost_us, spans_per_step
    from fthsdp.bench.results import OverheadResult, format_overhead

    with pytest.raises(ValueError, match="--against"):
        bench_overhead(against="nothing")
    assert spans_per_step("reference") == 11 and spans_per_step("tiny") == 9  # 6 phases + a bucket per FSDP unit
    assert 0 < span_cost_us(1000) < 1000
    r = OverheadResult(3, 2, "reference", 60, 5, 3, 0.5, 1.0, 1.01, 1.01, [1.01], [1.0], [1.01],
                       baseline="fthsdp with its step timeline off", span_cost_us=1.0, spans_per_step=11)
    assert "one span 1.0 us, 11 per step: 1.09e-05 of a step" in format_overhead(r)


def test_fthsdp_trace_reads_the_members_the_status_lists_and_writes_a_valid_trace(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fthsdp.cli import main as cli
    from fthsdp.cli import trace as trace_cli

    srv, tl = _server(token="")  # a job without a token: loopback only
    try:
        srv.directory = [srv.address]
        tl.span("forward", "compute", 3, time.perf_counter(), time.perf_counter() + 0.01)
        member = {"replica_id": "replica-1", "incarnation": "inc-a", "catchup": srv.address}
        status = {"job": "job", "members": [member],
                  "history": [{"epoch": 1, "time": time.time(), "reason": "boot", "members": ["replica-1"],
                               "events": []}]}
        monkeypatch.setattr(trace_cli, "fetch_status", lambda *a: (status, []))
        monkeypatch.delenv("FTHSDP_TOKEN_FILE", raising=False)
        out = tmp_path / "t.json"
        cli.main(["trace", "--out", str(out), "--png", str(tmp_path / "t.png")])
        doc = json.loads(out.read_text())
        assert chrome.problems(doc) == [] and chrome.rank_tracks(doc) == {"replica-1": ["rank 0"]}
        assert (tmp_path / "t.png").stat().st_size > 1000 and "replica-1: rank 0" in capsys.readouterr().out
        monkeypatch.setattr(trace_cli, "fetch_status", lambda *a: (None, ["127.0.0.1:1: refused"]))
        with pytest.raises(SystemExit, match="cannot reach any lighthouse"):
            cli.main(["trace", "--out", str(out)])
    finally:
        srv.close(drain_s=0)
