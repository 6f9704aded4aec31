"""A member's lane store (docs/design.md §5, "Lanes at scale"): the rendezvous of the lanes this member hosts
(``lighthouse.lane_hosts``), served by the member itself so that a membership change costs the lighthouse nothing
per rank.

``LaneStoreServer`` serves ``fthsdp.v1.Rendezvous`` (the same operations as the lighthouse's: ``lighthouse.
rendezvous_ops``) for one job, on a gRPC server and event loop of its own thread. Every request carries a MAC of its
bytes under the job's catch-up key (``ftar.store_mac``); a request without one, with a wrong one, replayed, for
another job, or for an epoch far from the member's own is refused (UNAUTHENTICATED / INVALID_ARGUMENT) and changes
nothing. Without a key the server listens on loopback only. ``MemberStore`` is its ``torch.distributed.Store``
client: the lighthouse store's calls (``ftar.store.LighthouseStore``), signed, and never redirected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ftar import store_mac
from ftar.devices import start_thread
from ftar.errors import FTARError
from ftar.store import RPC_MARGIN_S, LighthouseStore, StoreTarget
from lighthouse.epoch_view import EpochView
from lighthouse.errors import ValidationError
from lighthouse.rendezvous import KEEP_EPOCHS, Limits
from lighthouse.rendezvous_ops import METHODS, LiveTable, Req, Resp
from lighthouse.security import ClientSecurity
from lighthouse.v1 import lighthouse_pb2 as pb

log = logging.getLogger("fthsdp.ftar")

SERVICE = "fthsdp.v1.Rendezvous"
AHEAD = 8
"""Epochs above the member's own that its store admits: a lane's member may hear of an epoch before its host."""
START_S = 10.0
"""How long the server has to start."""


class InsecureLaneStore(FTARError):
    """A lane store without a key (no job token) was asked to listen off loopback."""


class LaneStoreServer:
    """The lane store of one member (one process: every lane of it), serving ``job_id``'s namespaces near the
    member's epoch (``epoch()``)."""

    def __init__(self, job_id: str, key: str, host: str, epoch: Callable[[], EpochView | None],
                 limits: Limits | None = None) -> None:
        if not store_mac.serving_allowed(host, key):
            raise InsecureLaneStore(f"the lane store has no key (no job token: FTHSDP_TOKEN_FILE), so it serves on "
                                    f"loopback only, not on {host!r}")
        self.job_id = job_id
        self._epoch = epoch
        self._verifier = store_mac.Verifier(key)
        self._limits = limits
        self._live: LiveTable | None = None
        self._loop = asyncio.new_event_loop()
        self._server: Any = None
        self._stopped: asyncio.Event | None = None
        started = threading.Event()
        errors: list[BaseException] = []
        port: list[int] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                port.append(self._loop.run_until_complete(self._start(host)))
            except BaseException as e:  # handed to the constructor
                errors.append(e)
                started.set()
                return
            started.set()
            self._loop.run_until_complete(self._serve())

        self._thread = start_thread(run, name="ftar-lane-store", device=None)
        if not started.wait(START_S) or errors:
            raise errors[0] if errors else TimeoutError("the lane store did not start")
        self.address = f"{host}:{port[0]}"
        """Where the lane's members reach it (``host:port``)."""

    async def _start(self, host: str) -> int:
        self._live = LiveTable(self.job_id, self._limits)
        self._stopped = asyncio.Event()
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(self._handler(name), request_deserializer=None,
                                                      response_serializer=Resp.SerializeToString)
            for name in METHODS}),))
        port = self._server.add_insecure_port(f"{host}:0")
        await self._server.start()
        return int(port)

    async def _serve(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()
        await self._server.stop(grace=None)

    def _handler(self, name: str) -> Callable[[bytes, Any], Any]:
        method = f"/{SERVICE}/{name}"

        async def handle(body: bytes, context: Any) -> Resp:
            metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
            why = self._verifier.refusal(method, body, metadata, time.time())
            if why is not None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"lane store: {why}")
            try:
                req = Req.FromString(body)
                if req.job_id != self.job_id:
                    raise ValidationError(f"this lane store serves job {self.job_id!r}, not {req.job_id[:64]!r}")
                epoch = self._epoch()
                current, plane = (epoch.number, epoch.data_plane) if epoch is not None else (1, 1)
                assert self._live is not None
                ns = self._live.namespace(req, current + AHEAD, plane, KEEP_EPOCHS + AHEAD)
                return await self._live.call(name, req, ns)
            except (ValidationError, ValueError, DecodeError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lane store: {e}")
            raise AssertionError("unreachable")  # pragma: no cover: abort raises

        return handle

    def close(self) -> None:
        """Stop serving (calls in flight are cancelled) and end the thread."""
        if self._thread.is_alive() and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(START_S)


class MemberStore(LighthouseStore):
    """The keys of one namespace of a member's lane store at ``address``, each request signed with ``key``."""

    def __init__(self, address: str, key: str, job_id: str, namespace: str, timeout: timedelta) -> None:
        super().__init__(StoreTarget(address, ClientSecurity(), job_id), namespace, timeout)
        self._key = key
        self._calls: dict[str, Any] = {}

    def _rpc(self, method: str, timeout_s: float = 0.0, **fields: Any) -> pb.RendezvousResponse:
        body = self._request(timeout_s, **fields).SerializeToString()
        path = f"/{SERVICE}/{method}"
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(self._address)
                self._calls = {}
            call = self._calls.get(path)
            if call is None:
                call = self._calls[path] = self._channel.unary_unary(
                    path, request_serializer=None, response_deserializer=Resp.FromString)
        try:
            resp: pb.RendezvousResponse = call(body, timeout=timeout_s + RPC_MARGIN_S,
                                               metadata=store_mac.sign(self._key, path, body, time.time()))
            return resp
        except grpc.RpcError as e:
            raise self._refused("lane store", method, e) from None

    def _reconnect(self, address: str) -> None:
        with self._lock:
            channel, self._channel, self._calls, self._address = self._channel, None, {}, address
        if channel is not None:
            channel.close()

    def clone(self) -> MemberStore:
        twin = MemberStore(self._address, self._key, self.target.job_id, self.namespace, self._wait)
        self._clones.append(twin)
        return twin

