"""Property-based tests (hypothesis) against a running lighthouse with a job token: malformed bytes, oversized
messages, invalid fields, wrong or missing tokens and out-of-order calls all get a clear gRPC error (never
UNKNOWN/INTERNAL), change no state, and leave the server serving."""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lighthouse import membership as m
from lighthouse import validate
from lighthouse.security import ClientSecurity, ServerSecurity
from lighthouse.v1 import lighthouse_pb2 as pb
from tests.helpers.lighthouse import JOB, SLOW_POLICY, ServerThread, make_config

TOKEN = "fuzz-token-42"
GOOD = ClientSecurity(token=TOKEN).metadata()
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLEAR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.ABORTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
UNARY: dict[str, Any] = {
    "Register": pb.RegisterRequest, "Heartbeat": pb.HeartbeatRequest, "ReportFailure": pb.FailureReport,
    "Ready": pb.ReadyRequest, "Leave": pb.LeaveRequest, "Status": pb.StatusRequest,
}
METHOD = "/fthsdp.v1.Lighthouse/"


class Target:
    """A lighthouse with a job token, a (active, epoch 1) and b (registered, not yet in the data plane), and a
    raw channel to it."""

    def __init__(self) -> None:
        self.server = ServerThread(make_config(SLOW_POLICY, security=ServerSecurity(token=TOKEN)))
        self.channel = grpc.insecure_channel(self.server.addr)
        self.incs = {"a": "a-inc", "b": "b-inc"}
        for rid, inc in self.incs.items():
            self.call("Register", pb.RegisterRequest(job_id=JOB, replica_id=rid, incarnation=inc,
                                                     shard_count=1).SerializeToString())

    def call(self, method: str, raw: bytes, metadata: Any = GOOD, timeout: float = 5.0) -> bytes:
        fn = self.channel.unary_unary(METHOD + method, request_serializer=None, response_deserializer=None)
        return fn(raw, timeout=timeout, metadata=metadata)  # type: ignore[no-any-return]

    def state(self) -> m.State:
        return self.server.state()

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


def refused_clearly(t: Target, method: str, raw: bytes, metadata: Any = GOOD) -> grpc.StatusCode:
    """Call, expecting a clear refusal; the server must still answer a good Status afterwards."""
    with pytest.raises(grpc.RpcError) as info:
        t.call(method, raw, metadata)
    code, details = info.value.code(), info.value.details()  # type: ignore[attr-defined]
    assert code in CLEAR_CODES, (code, details)
    assert details and len(details) < 2048
    return code  # type: ignore[no-any-return]


def _job_of(method: str, raw: bytes) -> str | None:
    """The job a request names, or None when it does not parse."""
    try:
        return UNARY[method].FromString(raw).job_id  # type: ignore[no-any-return]
    except Exception:
        return None


# --- malformed bytes and wrong tokens -------------------------------------------------------------------------------


@FAST
@given(method=st.sampled_from(sorted(UNARY)), raw=st.binary(max_size=4096),
       token=st.sampled_from([TOKEN, None, "wrong", TOKEN + " ", "Bearer"]))
def test_random_bytes_get_a_clear_error_and_change_nothing(target: Target, method: str, raw: bytes,
                                                           token: str | None) -> None:
    authed = token == TOKEN
    # Bytes that happen to decode into a request for the served job are real requests: not this property's.
    assume(not (authed and _job_of(method, raw) == JOB))
    before = target.state()
    code = refused_clearly(target, method, raw, ClientSecurity(token=token).metadata() if token else ())
    if not authed:
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert target.state() == before


@settings(max_examples=8, deadline=None)
@given(size=st.integers(validate.MAX_MESSAGE_BYTES + 1, 4 * validate.MAX_MESSAGE_BYTES),
       method=st.sampled_from(sorted(UNARY)))
def test_oversized_messages_are_resource_exhausted(target: Target, size: int, method: str) -> None:
    before = target.state()
    raw = pb.RegisterRequest(job_id=JOB, replica_id="z", incarnation="z", shard_count=1,
                             endpoints=pb.Endpoints(data_plane="x" * size)).SerializeToString()
    assert refused_clearly(target, method, raw) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert target.state() == before


@pytest.mark.parametrize("raw", [b"\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x12\x07default"])
def test_watch_with_malformed_or_unknown_requests_is_refused(target: Target, raw: bytes) -> None:
    fn = target.channel.unary_stream(METHOD + "Watch", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        next(iter(fn(raw, timeout=5, metadata=GOOD)))
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as info:
        next(iter(fn(pb.WatchRequest(job_id=JOB).SerializeToString(), timeout=5, metadata=())))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


# --- well-formed messages with invalid fields ----------------------------------------------------------------------

VALID_ID = st.from_regex(validate.ID_RE, fullmatch=True)
BAD_ID = st.one_of(
    st.just(""),
    st.text(string.ascii_letters, min_size=129, max_size=400),
    st.text(min_size=1, max_size=40).filter(lambda s: not validate.ID_RE.fullmatch(s)),
)
LONG = st.text(min_size=validate.ENDPOINT_MAX + 1, max_size=validate.ENDPOINT_MAX + 300)


@FAST
@given(data=st.data(), bad=st.sampled_from(["replica_id", "incarnation", "shard_count", "endpoint", "layout"]))
def test_register_with_an_invalid_field_is_invalid_argument(target: Target, data: st.DataObject, bad: str) -> None:
    req = pb.RegisterRequest(job_id=JOB, replica_id=data.draw(VALID_ID), incarnation=data.draw(VALID_ID),
                             shard_count=data.draw(st.integers(1, validate.SHARD_MAX)))
    if bad in ("replica_id", "incarnation"):
        setattr(req, bad, data.draw(BAD_ID))
    elif bad == "shard_count":
        req.shard_count = data.draw(st.one_of(st.just(0), st.integers(validate.SHARD_MAX + 1, 2**32 - 1)))
    elif bad == "layout":
        req.layout = data.draw(st.one_of(st.text(string.ascii_letters, min_size=257, max_size=400),
                                         st.text(min_size=1, max_size=40).filter(
                                             lambda s: not validate.LAYOUT.fullmatch(s))))
    else:
        setattr(req.endpoints, data.draw(st.sampled_from(["data_plane", "catchup", "http"])), data.draw(LONG))
    before = target.state()
    assert refused_clearly(target, "Register", req.SerializeToString()) == grpc.StatusCode.INVALID_ARGUMENT
    assert target.state() == before


# --- out-of-order calls -------------------------------------------------------------------------------------------

RIDS = st.sampled_from(["a", "b", "ghost", "never-registered"])
STALE_INC = st.sampled_from(["", "stale", "a-old", "b-0"]) | VALID_ID.filter(lambda s: s not in ("a-inc", "b-inc"))


@st.composite
def out_of_order_call(draw: st.DrawFn) -> tuple[str, bytes]:
    """A call that names a replica by an incarnation the lighthouse does not hold (a stale or never-registered
    process), or asks a transition out of order."""
    kind = draw(st.sampled_from(["Heartbeat", "Ready", "Leave", "ReportFailure", "ReadyActiveEarly"]))
    rid, inc = draw(RIDS), draw(STALE_INC)
    if kind == "Heartbeat":
        msg: Any = pb.HeartbeatRequest(job_id=JOB, replica_id=rid, incarnation=inc, step=draw(st.integers(0, 2**62)),
                                       epoch=draw(st.integers(0, 2**62)))
    elif kind == "Ready":
        msg = pb.ReadyRequest(job_id=JOB, replica_id=rid, incarnation=inc,
                              role=draw(st.sampled_from([pb.ROLE_ACTIVE, pb.ROLE_JOINING])))
    elif kind == "Leave":
        msg = pb.LeaveRequest(job_id=JOB, replica_id=rid, incarnation=inc, reason=draw(st.text(max_size=50)))
    elif kind == "ReportFailure":
        msg = pb.FailureReport(job_id=JOB, reporter_replica_id=rid, reporter_incarnation=inc,
                               suspect_replica_id=draw(RIDS), epoch=draw(st.integers(0, 2**62)),
                               reason=draw(st.text(max_size=50)))
    else:  # b, with its real incarnation, turning active before it ever entered the data plane as a joiner
        kind, msg = "Ready", pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation="b-inc", role=pb.ROLE_ACTIVE)
    return kind, msg.SerializeToString()


@FAST
@given(calls=st.lists(out_of_order_call(), min_size=1, max_size=6))
def test_out_of_order_calls_are_refused_and_change_nothing(target: Target, calls: list[tuple[str, bytes]]) -> None:
    before = target.state()
    for method, raw in calls:
        refused_clearly(target, method, raw)
    assert target.state() == before
    # The real members are untouched and still served.
    hb = pb.HeartbeatResponse.FromString(target.call("Heartbeat", pb.HeartbeatRequest(
        job_id=JOB, replica_id="a", incarnation="a-inc").SerializeToString()))
    assert hb.epoch == before.epoch.number  # type: ignore[union-attr]


# --- the HTTP side port -------------------------------------------------------------------------------------------

HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=80)


@FAST
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "BREW"]),
       path=st.sampled_from(["/", "/status", "/metrics", "/healthz", "/nope"])
       | HEADER_TEXT.map(lambda s: "/" + s.replace(" ", "%20")),
       auth=st.one_of(st.none(), st.just(f"Bearer {TOKEN}"), HEADER_TEXT, HEADER_TEXT.map(lambda s: "Basic " + s)))
def test_http_side_port_gives_clear_answers_and_changes_nothing(target: Target, method: str, path: str,
                                                                auth: str | None) -> None:
    import http.client

    before = target.state()
    conn = http.client.HTTPConnection(target.server.http, timeout=5)
    try:
        conn.request(method, path, headers={"Authorization": auth} if auth is not None else {})
        resp = conn.getresponse()
        resp.read()
    finally:
        conn.close()
    assert resp.status in (200, 400, 401, 404, 501), resp.status  # never a 5xx crash
    bare = path.split("?", 1)[0]
    if resp.status == 200 and bare != "/healthz":
        assert method in ("GET", "HEAD") and auth == f"Bearer {TOKEN}"
    if method == "GET" and bare != "/healthz" and auth != f"Bearer {TOKEN}":
        assert resp.status == 401
    assert target.state() == before
