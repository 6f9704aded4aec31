"""No unauthenticated side channel (issue 15): with a job token, a client without it can neither read nor write the
data-plane rendezvous (the lighthouse's gRPC Rendezvous service; no TCPStore is hosted) nor fetch a snapshot, and
the token never crosses the wire in clear in anything the catch-up client sends (captured by a recording proxy on
loopback). Holders of the token build a Gloo group from the store (the conformance suite every rendezvous store
passes: ``tests.helpers.store_conformance``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest
import torch
import torch.distributed as dist

from ftar.store import LighthouseStore, StoreRefused, StoreTarget, on_lighthouse
from fthsdp.catchup.client import Fetch, Source
from fthsdp.catchup.server import CatchupServer
from fthsdp.catchup.wire import FetchFailed
from lighthouse.epoch_view import EpochView
from lighthouse.errors import SecurityConfigError
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from lighthouse.security import ClientSecurity, ServerSecurity
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers import store_conformance
from tests.helpers.catchup import training
from tests.helpers.lighthouse import JOB, ServerThread, make_config
from tests.helpers.proxy import Proxy

pytestmark = pytest.mark.timeout(120)
TOKEN = "side-channel-token-7f3a9c"


@pytest.fixture
def lighthouse() -> Iterator[ServerThread]:
    srv = ServerThread(make_config(rendezvous=True, security=ServerSecurity(token=TOKEN)))
    try:
        with grpc.insecure_channel(srv.addr) as ch:
            r = pb_grpc.LighthouseStub(ch).Register(  # type: ignore[no-untyped-call]
                pb.RegisterRequest(job_id=JOB, replica_id="a", incarnation="i1", shard_count=1), timeout=10,
                metadata=ClientSecurity(token=TOKEN).metadata())
        assert r.epoch.number == 1 and r.epoch.rendezvous == f"members+lighthouse:{JOB}/epoch1"
        assert on_lighthouse(r.epoch.rendezvous) == f"lighthouse:{JOB}/epoch1"
        yield srv
    finally:
        srv.stop()


def _store(srv: ServerThread, token: str | None, wait_s: float = 2.0) -> LighthouseStore:
    return LighthouseStore(StoreTarget(srv.addr, ClientSecurity(token=token), JOB), f"{JOB}/epoch1",
                           timedelta(seconds=wait_s))


def test_the_rendezvous_needs_the_token_and_no_tcpstore_is_hosted(lighthouse: ServerThread) -> None:
    assert lighthouse.lh._tcp_store is None and lighthouse.lh.rendezvous_addr == "members:"
    good = _store(lighthouse, TOKEN)
    good.set("lane0/arrived/0", b"1")
    key = "lane0/arrived/0"
    calls: list[tuple[str, tuple[object, ...]]] = [
        ("set", (key, b"forged")), ("set", ("lane0/failed/1/2", b"1")), ("get", (key,)), ("check", ([key],)),
        ("add", ("lane0/n", 1)), ("delete_key", (key,)), ("num_keys", ()), ("compare_set", (key, b"1", b"x")),
        ("wait", ([key],))]
    for token in (None, "wrong"):
        bad = _store(lighthouse, token, wait_s=0.5)
        for method, args in calls:
            with pytest.raises(StoreRefused, match="UNAUTHENTICATED"):
                getattr(bad, method)(*args)
    assert good.get("lane0/arrived/0") == b"1" and good.num_keys() == 1  # nothing written by them
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT.*exceeds"):
        good.set("lane0/big", b"x" * 40_000)
    with pytest.raises(StoreRefused, match="INVALID_ARGUMENT"):
        LighthouseStore(StoreTarget(lighthouse.addr, ClientSecurity(token=TOKEN), JOB), f"{JOB}/epoch2",
                        timedelta(seconds=1)).set("k", b"1")  # an epoch that does not exist yet
    assert good.num_keys() == 1


def test_the_lighthouse_store_follows_torchs_store_semantics(lighthouse: ServerThread) -> None:
    store_conformance.check_semantics(lambda wait_s: _store(lighthouse, TOKEN, wait_s))


def test_blocking_gets_wait_on_the_lighthouse_until_the_key_is_set(lighthouse: ServerThread) -> None:
    store_conformance.check_blocking_get(lambda wait_s: _store(lighthouse, TOKEN, wait_s), waiters=20)


def _listening_on(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    out.append(local.rsplit(":", 1)[0])
    return out


def test_an_insecure_tcpstore_is_only_an_explicit_loopback_opt_in() -> None:
    """Refused off loopback; on loopback it listens on loopback only (issue 41: a TCPStore given a host listened on
    every interface whatever the host, so the guard held nothing)."""
    with pytest.raises(SecurityConfigError, match="loopback"):
        ServerThread(make_config(bind="0.0.0.0:0", rendezvous=True, insecure_tcp_rendezvous=True))
    srv = ServerThread(make_config(rendezvous=True, insecure_tcp_rendezvous=True))
    try:
        port = int(srv.lh.rendezvous_addr.rsplit(":", 1)[1])
        assert _listening_on(port) == ["0100007F"]  # 127.0.0.1 only, no wildcard
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        srv.stop()


def test_token_holders_build_a_gloo_group_from_the_store(lighthouse: ServerThread) -> None:
    store_conformance.check_gloo_group(lambda wait_s: _store(lighthouse, TOKEN, wait_s))


class RecordingProxy(Proxy):
    """A TCP proxy on loopback that records every byte the client sends through it."""

    def __init__(self, upstream: str) -> None:
        self.sent = bytearray()
        self._lock = threading.Lock()
        super().__init__(upstream, up=self._record)

    def _record(self, offset: int, data: bytes) -> bytes:
        with self._lock:
            self.sent += data
        return data


def test_catchup_needs_the_token_and_never_sends_it() -> None:
    epoch = EpochView(JOB, 2, (EpochMember("src", "i0", ACTIVE, 1, Endpoints()),
                               EpochMember("j", "i1", JOINING, 1, Endpoints())), "", 0.0, "test")
    copies: list[int] = []

    def snapshot() -> list[tuple[str, torch.Tensor]]:
        copies.append(1)
        return [("w", torch.arange(8, dtype=torch.float32))]

    srv = CatchupServer(job=JOB, replica_id="src", rank=0, world_size=1, snapshot=snapshot, token=TOKEN,
                        epoch=lambda: epoch, wait_s=10)
    proxy = RecordingProxy(srv.address)
    try:
        with training(srv, 1):
            for token in ("", "wrong"):
                with pytest.raises(FetchFailed, match="unauthenticated"):
                    Fetch([Source("src", proxy.address)], job=JOB, replica_id="j", incarnation="i1", rank=0, step=500,
                          token=token).start().result(30)
            assert not copies  # refused before anything was registered: no state copied
            got = Fetch([Source("src", proxy.address)], job=JOB, replica_id="j", incarnation="i1", rank=0, step=500,
                        token=TOKEN).start().result(60)
            assert torch.equal(got.tensors["w"], torch.arange(8, dtype=torch.float32)) and copies == [1]
            sent = bytes(proxy.sent)
            assert b'"proof"' in sent and b"FTCU" in sent  # the capture holds the handshakes
            assert TOKEN.encode() not in sent and TOKEN.encode().hex().encode() not in sent
    finally:
        proxy.close()
        srv.close(drain_s=1)
