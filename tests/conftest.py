"""Fixtures shared by the unit and integration tests: in-process lighthouses, gRPC stubs to them, one real etcd,
and the check that no test leaves a process behind. The helpers they use live in ``tests/helpers``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lighthouse import membership as m
from lighthouse.stores.base import Store
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.leaks import no_process_left_behind  # noqa: F401  (autouse: every test)
from tests.helpers.lighthouse import FAST_POLICY, SLOW_POLICY, TOKEN, ServerThread, make_config
from tests.helpers.tls_certs import Certs, make_certs, make_etcd_certs


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """Factory: ``start_server(policy=..., store=..., **config)``; every server is stopped at teardown."""
    servers: list[ServerThread] = []

    def start(policy: m.Policy = FAST_POLICY, store: Store | None = None, **kw: Any) -> ServerThread:
        s = ServerThread(make_config(policy, **kw), store)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def slow_server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(SLOW_POLICY)


@pytest.fixture
def channel_to() -> Iterator[Callable[[ServerThread], grpc.Channel]]:
    channels: list[grpc.Channel] = []

    def open_channel(s: ServerThread) -> grpc.Channel:
        ch = grpc.insecure_channel(s.addr)
        channels.append(ch)
        return ch

    yield open_channel
    for ch in channels:
        ch.close()


@pytest.fixture
def stub(server: ServerThread, channel_to: Callable[[ServerThread], grpc.Channel]) -> pb_grpc.LighthouseStub:
    return pb_grpc.LighthouseStub(channel_to(server))


@pytest.fixture
def slow_stub(slow_server: ServerThread,
              channel_to: Callable[[ServerThread], grpc.Channel]) -> pb_grpc.LighthouseStub:
    return pb_grpc.LighthouseStub(channel_to(slow_server))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real etcd for the session (tests isolate themselves by key prefix); fails if etcd is not installed."""
    from fthsdp.testing.etcd import EtcdCluster

    server = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Certs]]:
    """One real etcd for the session serving TLS only and requiring client certificates (``--client-cert-auth``,
    peers too), as deploy/k8s/etcd.yaml runs it; with the certificates (``client_*``: the lighthouse's)."""
    from fthsdp.testing.etcd import EtcdCluster, EtcdServerTLS

    c = make_etcd_certs(tmp_path_factory.mktemp("etcd-certs"))
    server = EtcdCluster(tmp_path_factory.mktemp("etcd-tls"),
                         tls=EtcdServerTLS(c.ca, c.server_cert, c.server_key, c.client_cert, c.client_key)).start()
    try:
        yield server, c
    finally:
        server.stop()


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made once for the session."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A file holding ``TOKEN`` (with a trailing newline, as editors write it)."""
    p = tmp_path_factory.mktemp("token") / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank Gloo process group in this process (over a HashStore: no network), for FSDP2 in a unit test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
