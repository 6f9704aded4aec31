"""The catch-up server and fetch, in one process over loopback: snapshots at commit boundaries, several sources,
checksums, failover, authentication and malformed input."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fthsdp.catchup import auth, wire
from fthsdp.catchup.client import Fetch, Source
from fthsdp.catchup.server import CatchupServer
from fthsdp.catchup.wire import FetchFailed, Hello, Kind, Refused
from lighthouse.epoch_view import EpochView
from lighthouse.model import JOINING, Endpoints, EpochMember
from tests.helpers.lighthouse import wait_until

pytestmark = pytest.mark.timeout(60)
INC = "inc1"
EPOCH = EpochView("job", 3, tuple(EpochMember(rid, INC, JOINING, 1, Endpoints()) for rid in ("joiner", "j", "x")),
                  "", 0.0, "test")
"""The sources' current epoch: the replicas that fetch in these tests are its joining members."""


def _state(seed: int, step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [("param/0", torch.randn(300_000, generator=g)), ("param/1", torch.randn(7, 3, generator=g)),
            ("optim/0/step", torch.tensor(float(step))), ("empty", torch.zeros(0)),
            ("data/cursors", torch.arange(3, dtype=torch.int64) + step),
            ("rng/cpu", torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=g))]


class Trainer:
    """Stands in for a replica's training thread: commits steps, calling at_commit and before_update, until
    stopped."""

    def __init__(self, server: CatchupServer, seed: int = 0) -> None:
        self.server, self.seed, self.step = server, seed, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.server.at_commit(self.step, active=True)
            self.stop.wait(0.01)  # a training step's worth of time (pacing, not synchronisation)
            self.server.before_update(self.step)
            self.step += 1


def _server(seed: int = 0, **kw: object) -> tuple[CatchupServer, Trainer]:
    holder: dict[str, Trainer] = {}
    kw.setdefault("epoch", lambda: EPOCH)
    srv = CatchupServer(job="job", replica_id=f"r{seed}", rank=0, world_size=1,
                        snapshot=lambda: [(n, t.clone()) for n, t in _state(0, holder["t"].step)],
                        chunk_bytes=64 << 10, **kw)  # type: ignore[arg-type]
    tr = Trainer(srv, seed)
    holder["t"] = tr
    tr.thread.start()
    return srv, tr


def _stop(*pairs: tuple[CatchupServer, Trainer]) -> None:
    for srv, tr in pairs:
        tr.stop.set()
        tr.thread.join(5)
        srv.close(drain_s=1)


def _throttle(step: int, n: int) -> None:
    """A source with a slow link (20 ms a chunk): every source is still sending when the others join in."""
    time.sleep(0.02)


def _fetch(sources: list[Source], step: int, **kw: object) -> Fetch:
    kw.setdefault("incarnation", INC)
    return Fetch(sources, job="job", replica_id="joiner", rank=0, step=step, batch_bytes=128 << 10,
                 **kw).start()  # type: ignore[arg-type]


def _expect_equal(got: dict[str, torch.Tensor], step: int) -> None:
    want = dict(_state(0, step))
    assert list(got) == list(want)
    for name, t in want.items():
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype, name


def test_two_sources_share_the_transfer_and_agree_on_the_step() -> None:
    a, b = _server(0, on_chunk_sent=_throttle), _server(1, on_chunk_sent=_throttle)
    try:
        step = max(a[1].step, b[1].step) + 20
        res = _fetch([Source("r0", a[0].address), Source("r1", b[0].address)], step).result(30)
        assert res.step == step
        _expect_equal(res.tensors, step)
        assert set(res.sources) == {"r0", "r1"} and all(v > 0 for v in res.sources.values())
        assert sum(res.sources.values()) == res.bytes and res.refetched_chunks == 0
    finally:
        _stop(a, b)
    # Both dropped their snapshot once the joiner said goodbye.
    assert not a[0]._snapshots and not b[0]._snapshots


def test_a_corrupted_chunk_is_detected_and_fetched_again() -> None:
    hits: list[tuple[int, int]] = []

    def corrupt(entry: int, offset: int, data: bytearray) -> bool:
        if entry == 0 and not hits:
            hits.append((entry, offset))
            data[10] ^= 0xFF
            return True
        return False

    a = _server(0, corrupt=corrupt)
    try:
        step = a[1].step + 20
        res = _fetch([Source("r0", a[0].address)], step).result(30)
        assert hits and res.refetched_chunks == 1
        _expect_equal(res.tensors, step)
    finally:
        _stop(a)


def test_a_source_that_dies_mid_transfer_is_replaced_by_another() -> None:
    killed = threading.Event()
    holder: dict[str, CatchupServer] = {}

    def die(step: int, n: int) -> None:  # the source's process dies after its first chunk: its sockets close
        if not killed.is_set():
            killed.set()
            raise wire.SourceLost("simulated death")

    a, b = _server(0, on_chunk_sent=die), _server(1, on_chunk_sent=_throttle)
    holder["a"] = a[0]
    try:
        step = max(a[1].step, b[1].step) + 20
        res = _fetch([Source("r0", a[0].address), Source("r1", b[0].address)], step).result(30)
        assert killed.is_set()
        assert res.source_failures and res.source_failures[0].startswith("r0")
        _expect_equal(res.tensors, step)
        assert res.sources["r1"] > 0
    finally:
        _stop(a, b)


def test_a_joiner_that_dies_mid_fetch_costs_the_source_nothing() -> None:
    a = _server(0)
    try:
        step = a[1].step + 20
        f = Fetch([Source("r0", a[0].address)], job="job", replica_id="j", rank=0, step=step, incarnation=INC,
                  on_chunk=lambda s, n: f.cancel())
        f.start()
        with pytest.raises(FetchFailed):
            f.result(30)
        deadline = time.monotonic() + 10
        while (a[0]._snapshots or a[0]._sessions) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition with a deadline
        assert not a[0]._snapshots and a[0]._sessions == 0, "the source kept the snapshot of a dead joiner"
        before = a[1].step
        deadline = time.monotonic() + 10
        while a[1].step < before + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a[1].step >= before + 5, "the source stopped training"
    finally:
        _stop(a)


@pytest.mark.parametrize("change,code", [({"token": "wrong"}, "unauthenticated"), ({"token": ""}, "unauthenticated"),
                                         ({"job": "other"}, "wrong_job"), ({"rank": 5}, "bad_request")])
def test_bad_hello_is_refused_with_a_clear_code(change: dict[str, object], code: str) -> None:
    a = _server(0, token="s3cret")
    try:
        fields: dict[str, object] = {"job": "job", "replica": "j", "incarnation": INC, "rank": 0,
                                     "step": a[1].step + 20, **change}
        token = str(fields.pop("token", "s3cret"))
        with socket.create_connection(_addr(a[0])) as s:
            s.settimeout(10)
            _, challenge = wire.recv_control(s, (Kind.CHALLENGE,))
            hello = Hello(**fields)  # type: ignore[arg-type]
            hello = Hello(**{**fields, "proof": auth.proof(token, wire.parse_challenge(challenge), hello)})  # type: ignore[arg-type]
            wire.send_control(s, Kind.HELLO, wire.hello_doc(hello))
            with pytest.raises(Refused) as e:
                wire.recv_control(s, (Kind.MANIFEST,))
            assert e.value.code == code
        assert not a[0]._requested and not a[0]._snapshots
    finally:
        _stop(a)


def test_a_step_already_past_is_refused_too_late() -> None:
    a = _server(0)
    try:
        wait_until(lambda: a[1].step >= 2, timeout=10)  # step 0's update is done
        with pytest.raises(FetchFailed, match="too_late"):
            _fetch([Source("r0", a[0].address)], 0).result(30)
    finally:
        _stop(a)


class HeldCopy:
    """A snapshot function that records its thread and, while ``hold`` is clear, waits (a copy in progress)."""

    def __init__(self, step: int) -> None:
        self.step, self.hold, self.entered = step, threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self) -> list[tuple[str, torch.Tensor]]:
        self.threads.append(threading.current_thread())
        self.entered.set()
        assert self.hold.wait(30)
        return [(n, t.clone()) for n, t in _state(0, self.step)]


def test_the_step_being_trained_is_served_off_the_training_thread_and_its_update_waits_for_the_copy() -> None:
    copy = HeldCopy(7)
    srv = CatchupServer(job="job", replica_id="r0", rank=0, world_size=1, snapshot=copy, epoch=lambda: EPOCH,
                        chunk_bytes=64 << 10)
    try:
        srv.at_commit(7, active=True)  # the boundary before step 7: its forward and backward run now
        f = _fetch([Source("r0", srv.address)], 7)
        assert f.wait_registered(10) == 1  # QUEUED: step 7 will be served
        assert copy.entered.wait(10) and copy.threads[0] is not threading.current_thread()
        update = threading.Thread(target=srv.before_update, args=(7,), daemon=True)
        update.start()
        update.join(0.3)
        assert update.is_alive(), "step 7's update ran while its snapshot was being copied"
        copy.hold.set()
        update.join(10)
        assert not update.is_alive()
        res = f.result(30)
        assert res.step == 7
        _expect_equal(res.tensors, 7)
        # After the update began, step 7's state is gone: a new request for it is too late.
        with pytest.raises(FetchFailed, match="too_late"):
            _fetch([Source("r0", srv.address)], 7).result(30)
    finally:
        copy.hold.set()
        srv.close(drain_s=1)


def test_a_request_for_a_coming_step_is_queued_and_copied_at_its_boundary() -> None:
    copy = HeldCopy(9)
    copy.hold.set()
    srv = CatchupServer(job="job", replica_id="r0", rank=0, world_size=1, snapshot=copy, epoch=lambda: EPOCH,
                        chunk_bytes=64 << 10)
    try:
        srv.at_commit(8, active=True)
        f = _fetch([Source("r0", srv.address)], 9)
        assert f.wait_registered(10) == 1 and not f.done() and not copy.entered.is_set()
        srv.before_update(8)
        assert not copy.entered.is_set()  # nothing copied for step 8, which nobody asked for
        srv.at_commit(9, active=True)
        res = f.result(30)
        assert res.step == 9 and copy.threads and copy.threads[0] is not threading.current_thread()
        _expect_equal(res.tensors, 9)
    finally:
        srv.close(drain_s=1)


def test_a_failing_snapshot_is_refused_unavailable_and_training_goes_on() -> None:
    def broken() -> list[tuple[str, torch.Tensor]]:
        raise RuntimeError("simulated bug in the snapshot")

    srv = CatchupServer(job="job", replica_id="r0", rank=0, world_size=1, snapshot=broken, epoch=lambda: EPOCH)
    try:
        srv.at_commit(4, active=True)
        with pytest.raises(FetchFailed, match="unavailable"):
            _fetch([Source("r0", srv.address)], 4).result(30)
        srv.before_update(4)  # does not wait for anything
        assert not srv._requested and not srv._snapshots
    finally:
        srv.close(drain_s=1)


def test_a_joining_replica_does_not_serve() -> None:
    srv = CatchupServer(job="job", replica_id="r", rank=0, world_size=1, snapshot=lambda: [], epoch=lambda: EPOCH)
    try:
        srv.at_commit(3, active=False)
        with pytest.raises(FetchFailed, match="not_active"):
            _fetch([Source("r", srv.address)], 5).result(30)
    finally:
        srv.close(drain_s=1)


def test_layout_mismatch_is_a_clear_error() -> None:
    a = _server(0)
    try:
        with pytest.raises(FetchFailed, match="layout differs"):
            _fetch([Source("r0", a[0].address)], a[1].step + 20, expected=[("param/0", "torch.float32", (1,))]
                   ).result(30)
    finally:
        _stop(a)


def _addr(srv: CatchupServer) -> tuple[str, int]:
    host, port = srv.address.rsplit(":", 1)
    return host, int(port)


_SHARED: dict[str, tuple[CatchupServer, Trainer]] = {}


def _shared() -> tuple[CatchupServer, Trainer]:
    if "a" not in _SHARED:
        _SHARED["a"] = _server(0, token="t")
    return _SHARED["a"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda k, n, body: struct.pack("!4sBBI", b"FTCU", wire.VERSION, k, n) + body,
              st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=64)),
    st.builds(lambda body: struct.pack("!4sBBI", b"FTCU", wire.VERSION, 1, len(body)) + body,
              st.one_of(st.binary(max_size=64), st.just(b'{"job":"job"}'), st.just(b"[1,2]"),
                        st.just(b'{"job":"job","replica":"x","incarnation":"inc1","rank":-1,"step":1,"proof":""}'),
                        st.just(b'{"job":"job","replica":"x","incarnation":"inc1","rank":0,"step":true,"proof":""}'),
                        st.just(b'{"job":"job","replica":"x","incarnation":"inc1","rank":0,"step":1,"proof":"00"}'),
                        st.just(b'{"job":"job","token":"t","replica":"x","rank":0,"step":1}'))),
))
def test_malformed_input_gets_an_error_and_changes_nothing(data: bytes) -> None:
    srv, tr = _shared()
    with socket.create_connection(_addr(srv)) as s:
        s.settimeout(5)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    # The session opens with the challenge; after it, either an ERROR frame or a plain close (truncated input):
    # never a manifest, never a crash.
    assert reply[:4] == b"FTCU" and reply[5] == Kind.CHALLENGE, reply[:40]
    reply = reply[wire.FRAME.size + struct.unpack("!I", reply[6:10])[0]:]
    if reply:
        assert reply[:4] == b"FTCU" and reply[5] == Kind.ERROR, reply[:40]
    assert not srv._requested and not srv._snapshots and srv._acceptor.is_alive()


def teardown_module() -> None:
    if "a" in _SHARED:
        _stop(_SHARED.pop("a"))


def test_no_source_fails_at_once_with_a_clear_error() -> None:
    f = _fetch([], 5)
    assert f.done()
    with pytest.raises(FetchFailed, match="no healthy replica"):
        f.result(1)


# --- hardening (issue 41) ---------------------------------------------------------------------------------------


def test_idle_connections_never_keep_a_joiner_out() -> None:
    """64 connections that never answer the challenge hold handshake places for ``handshake_s``, never one of the
    ``max_sessions`` sessions: a joiner is served meanwhile, and the server drops them at the deadline."""
    a = _server(0, max_sessions=2, handshake_s=1.0)
    idle = [socket.create_connection(_addr(a[0]), timeout=10) for _ in range(64)]
    try:
        res = _fetch([Source("r0", a[0].address)], a[1].step + 20).result(30)
        _expect_equal(res.tensors, res.step)
        for s in idle:  # each was sent its challenge, then closed once its deadline passed
            wire.recv_control(s, (Kind.CHALLENGE,))
            s.settimeout(10)
            assert s.recv(1 << 16) == b""
        wait_until(lambda: a[0]._pending == 0, 10, what="the idle connections' places were given back")
    finally:
        for s in idle:
            s.close()
        _stop(a)


def test_a_full_handshake_pool_closes_its_oldest_connection_for_a_newcomer() -> None:
    """Every handshake place held by an idle connection (here 2 of 2; anyone who reaches the port can open them,
    from any number of addresses): a joiner still gets in, in the place of the one that waited longest."""
    a = _server(0, max_pending=2, handshake_s=30.0)
    idle = [socket.create_connection(_addr(a[0]), timeout=10) for _ in range(2)]
    try:
        wait_until(lambda: a[0]._pending == 2, 10, what="both idle connections in their handshake")
        res = _fetch([Source("r0", a[0].address)], a[1].step + 20).result(30)
        _expect_equal(res.tensors, res.step)
        assert a[0].evicted >= 1
        closed = 0
        for s in idle:  # each was sent its challenge; the evicted ones are closed long before their 30 s deadline
            wire.recv_control(s, (Kind.CHALLENGE,))
            s.settimeout(2)
            with contextlib.suppress(TimeoutError):
                closed += s.recv(1 << 16) == b""
        assert closed == a[0].evicted
    finally:
        for s in idle:
            s.close()
        _stop(a)


def test_a_joiner_takes_a_snapshot_only_from_a_source_that_proves_the_token() -> None:
    """A source of another job (its own token) is refused by the joiner, however willing it is to serve."""
    honest, impostor = _server(0, token="s3cret"), _server(1, token="other")
    try:
        res = _fetch([Source("r0", honest[0].address)], honest[1].step + 20, token="s3cret").result(30)
        _expect_equal(res.tensors, res.step)
        with pytest.raises(FetchFailed, match="did not prove the job token|unauthenticated"):
            _fetch([Source("r1", impostor[0].address)], impostor[1].step + 20, token="s3cret").result(30)
    finally:
        _stop(honest, impostor)


def test_the_sources_proof_is_bound_to_the_joiners_nonce_and_the_source() -> None:
    hello = Hello("job", "joiner", INC, 0, 5, nonce="n" * 64)
    good = auth.source_proof("t", hello, "r0")
    assert auth.verify_source("t", hello, "r0", good)
    assert not auth.verify_source("t", hello, "r1", good)  # another source's name
    assert not auth.verify_source("t", Hello("job", "joiner", INC, 0, 5, nonce="m" * 64), "r0", good)  # replayed
    assert not auth.verify_source("t", hello, "r0", auth.proof("t", hello.nonce, hello))  # a joiner's proof
    assert auth.verify_source("", hello, "r0", "")  # no token: loopback only


@pytest.mark.parametrize("bound", ["max_bytes", "params"])
def test_a_manifest_bigger_or_other_than_this_ranks_state_is_refused_before_any_allocation(bound: str) -> None:
    a = _server(0)
    kw: dict[str, object] = {"max_bytes": 1 << 20} if bound == "max_bytes" else {
        "expected": [("param/0", "torch.float32", (300_000,)), ("param/1", "torch.float32", (3, 7))]}
    try:
        with pytest.raises(FetchFailed, match="more than the|layout differs"):
            _fetch([Source("r0", a[0].address)], a[1].step + 20, **kw).result(30)
        fits = {"max_bytes": 8 << 20} if bound == "max_bytes" else {
            "expected": [("param/0", "torch.float32", (300_000,)), ("param/1", "torch.float32", (7, 3))]}
        res = _fetch([Source("r0", a[0].address)], a[1].step + 40, **fits).result(30)
        _expect_equal(res.tensors, res.step)
    finally:
        _stop(a)


def test_a_tiny_chunk_size_is_a_protocol_error() -> None:
    doc = wire.manifest_doc(wire.Manifest(1, (), 64 << 10))
    assert wire.parse_manifest(doc).chunk_bytes == 64 << 10
    with pytest.raises(wire.ProtocolError, match="chunk_bytes"):
        wire.parse_manifest({**doc, "chunk_bytes": 1})
