"""Lighthouse clients: an asyncio core (``AsyncLighthouseClient``, used directly by the emulator to drive
thousands of replicas from one process) and a thread-backed wrapper (``LighthouseClient``) for the runtime,
whose training loop must never block on the lighthouse.

Every call has a deadline. The background session heartbeats, keeps a watch stream open (reconnecting with
jittered exponential backoff, rotating through the given lighthouse addresses), and re-registers if the
lighthouse lost or dropped it. With several lighthouses on one etcd (HA), a follower's refusal names the leader
(trailing metadata ``fthsdp-leader``) and the client goes there at once; otherwise it rotates. TLS and the job
token come in a ``ClientSecurity``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Coroutine, Sequence, TypeVar

import grpc
from google.protobuf.message import DecodeError

from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from lighthouse import membership as m
from lighthouse import wire
from lighthouse.errors import (Busy, FencedOut, InvalidRequest, LighthouseError, LighthouseUnavailable, NotLeader,
                               Unauthenticated, UnknownTarget)
from lighthouse.security import LEADER_METADATA, ClientSecurity
from lighthouse.wire import EpochView

log = logging.getLogger("fthsdp.lighthouse.client")
T = TypeVar("T")
WATCH_METHOD = "/fthsdp.v1.Lighthouse/Watch"

_ERRORS: dict[grpc.StatusCode, type[LighthouseError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: UnknownTarget,
    grpc.StatusCode.FAILED_PRECONDITION: FencedOut,
    grpc.StatusCode.ABORTED: Busy,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
}


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list -> list; refuses an empty one."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    items = [a.strip() for a in items if a.strip()]
    if not items:
        raise ValueError("no lighthouse address given")
    return items


def _leader_hint(e: grpc.aio.AioRpcError | grpc.RpcError) -> str | None:
    """The leader a follower named in its refusal (None: not a follower's refusal; '': no leader known)."""
    try:
        md = e.trailing_metadata() or ()  # type: ignore[union-attr]
    except Exception:
        return None
    for key, value in md:
        if key == LEADER_METADATA:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def _translate(e: grpc.aio.AioRpcError | grpc.RpcError, what: str) -> LighthouseError:
    code = e.code()
    hint = _leader_hint(e) if code == grpc.StatusCode.UNAVAILABLE else None
    if hint is not None:
        return NotLeader(f"{what}: {code.name}: {e.details()}", hint)
    cls = _ERRORS.get(code, LighthouseUnavailable)
    return cls(f"{what}: {code.name}: {e.details()}")


def _cancelled_by_grpc() -> bool:
    """Whether a CancelledError being handled came from grpc (a call cancelled because its channel closed)
    rather than from a cancellation of the running task, which must propagate."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


@dataclass(frozen=True)
class Registration:
    incarnation: str
    role: str
    epoch: EpochView
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    resume: bool = False
    """The job trained before and nobody is left to catch up from: resume from a checkpoint."""


@dataclass(frozen=True)
class ReportResult:
    confirmed: bool
    detail: str
    epoch: int


class AsyncLighthouseClient:
    """One replica's view of the lighthouse, on the caller's event loop."""

    def __init__(self, addresses: str | Sequence[str], job_id: str, replica_id: str, *, shard_count: int = 1,
                 endpoints: m.Endpoints = m.Endpoints(), incarnation: str | None = None,
                 rpc_timeout_s: float = 2.0, security: ClientSecurity | None = None) -> None:
        self.addresses = parse_addresses(addresses)
        self.security = security or ClientSecurity()
        self._metadata = self.security.metadata()
        self.job_id = job_id
        self.replica_id = replica_id
        self.shard_count = shard_count
        self.endpoints = endpoints
        self.incarnation = incarnation or uuid.uuid4().hex[:16]
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_interval_s = 0.5
        self.role = ""
        self.heartbeats = 0
        """Heartbeats the lighthouse accepted."""
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.LighthouseStub | None = None

    # --- connection -------------------------------------------------------------------------------------

    def _stub_now(self) -> pb_grpc.LighthouseStub:
        if self._stub is None:
            self._channel = self.security.channel(self.addresses[self._index % len(self.addresses)])
            self._stub = pb_grpc.LighthouseStub(self._channel)
        return self._stub

    @property
    def address(self) -> str:
        """The lighthouse address in use now."""
        return self.addresses[self._index % len(self.addresses)]

    async def _rotate(self, failed: grpc.aio.Channel | None, leader: str = "") -> bool:
        """Drop the channel ``failed`` and move on (after an UNAVAILABLE): to ``leader`` when a follower named
        one of our addresses, else to the next address. True when it moved to a named leader.

        Only if it is still the current one: the heartbeat and the watch share the channel, and both may see
        the same outage; the second must not throw away the fresh channel the first one made."""
        if failed is None or failed is not self._channel:
            return False
        self._channel, self._stub = None, None
        to_leader = bool(leader) and leader in self.addresses and leader != self.address
        if to_leader:
            log.info("replica=%s lighthouse %s does not lead; going to the leader %s", self.replica_id,
                     self.address, leader)
            self._index = self.addresses.index(leader)
        else:
            self._index += 1
        await failed.close(grace=None)
        return to_leader

    async def _call(self, method: str, request: object, timeout: float | None = None) -> object:
        for attempt in (1, 2):  # a second, at once, only after a redirect to the named leader
            stub = self._stub_now()
            channel = self._channel
            try:
                return await getattr(stub, method)(request, timeout=timeout or self.rpc_timeout_s,
                                                   metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                err = _translate(e, f"{method} for replica {self.replica_id} at {self.address}")
                if isinstance(err, LighthouseUnavailable):
                    moved = await self._rotate(channel, err.leader if isinstance(err, NotLeader) else "")
                    if moved and attempt == 1:
                        continue
                raise err from None
            except asyncio.CancelledError:
                if not _cancelled_by_grpc():
                    raise
                raise LighthouseUnavailable(f"{method} for replica {self.replica_id}: call cancelled "
                                            "(its channel was closed)") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel = self._stub = None

    # --- calls --------------------------------------------------------------------------------------------

    async def register(self) -> Registration:
        resp = await self._call("Register", pb.RegisterRequest(
            job_id=self.job_id, replica_id=self.replica_id, shard_count=self.shard_count,
            incarnation=self.incarnation,
            endpoints=pb.Endpoints(data_plane=self.endpoints.data_plane, catchup=self.endpoints.catchup,
                                   http=self.endpoints.http)))
        assert isinstance(resp, pb.RegisterResponse)
        self.role = wire.ROLE_FROM_PB.get(resp.role, m.JOINING)
        self.heartbeat_interval_s = resp.heartbeat_interval_s or self.heartbeat_interval_s
        return Registration(resp.incarnation, self.role, wire.epoch_from_pb(resp.epoch),
                            resp.heartbeat_interval_s, resp.heartbeat_timeout_s, resp.resume)

    async def heartbeat(self, step: int = 0, epoch: int = 0) -> int:
        resp = await self._call("Heartbeat", pb.HeartbeatRequest(
            job_id=self.job_id, replica_id=self.replica_id, incarnation=self.incarnation, step=step, epoch=epoch))
        assert isinstance(resp, pb.HeartbeatResponse)
        self.heartbeats += 1
        return resp.epoch

    async def report_failure(self, suspect: str, epoch: int, reason: str) -> ReportResult:
        resp = await self._call("ReportFailure", pb.FailureReport(
            job_id=self.job_id, reporter_replica_id=self.replica_id, reporter_incarnation=self.incarnation,
            suspect_replica_id=suspect, epoch=epoch, reason=reason[: wire.REASON_MAX]))
        assert isinstance(resp, pb.FailureReportResponse)
        return ReportResult(resp.confirmed, resp.detail, resp.epoch)

    async def ready(self, role: str) -> int:
        resp = await self._call("Ready", pb.ReadyRequest(job_id=self.job_id, replica_id=self.replica_id,
                                                         incarnation=self.incarnation, role=wire.ROLE_TO_PB[role]))
        assert isinstance(resp, pb.ReadyResponse)
        if role == m.ACTIVE:
            self.role = m.ACTIVE
        return resp.epoch

    async def leave(self, reason: str = "") -> int:
        resp = await self._call("Leave", pb.LeaveRequest(job_id=self.job_id, replica_id=self.replica_id,
                                                         incarnation=self.incarnation, reason=reason))
        assert isinstance(resp, pb.LeaveResponse)
        return resp.epoch

    async def status(self) -> pb.StatusResponse:
        resp = await self._call("Status", pb.StatusRequest(job_id=self.job_id))
        assert isinstance(resp, pb.StatusResponse)
        return resp

    async def watch(self, after_epoch: int = 0) -> AsyncIterator[EpochView]:
        """Yield every epoch newer than ``after_epoch`` as it is pushed; raises when the stream breaks."""
        self._stub_now()
        channel = self._channel
        assert channel is not None
        # Raw bytes (no response deserializer): the views are memoized by content, see wire.epoch_from_bytes.
        call = channel.unary_stream(WATCH_METHOD, request_serializer=pb.WatchRequest.SerializeToString)(
            pb.WatchRequest(job_id=self.job_id, after_epoch=after_epoch), metadata=self._metadata)
        try:
            async for raw in call:
                try:
                    view = wire.epoch_from_bytes(raw)
                except DecodeError as e:
                    raise LighthouseUnavailable(f"Watch for replica {self.replica_id}: bad epoch: {e}") from None
                yield view
        except grpc.aio.AioRpcError as e:
            err = _translate(e, f"Watch for replica {self.replica_id} at {self.address}")
            if isinstance(err, LighthouseUnavailable):
                await self._rotate(channel, err.leader if isinstance(err, NotLeader) else "")
            raise err from None
        except asyncio.CancelledError:
            # The heartbeat closed the shared channel (rotation): the stream broke, the watch loop goes on.
            if not _cancelled_by_grpc():
                raise
            raise LighthouseUnavailable(f"Watch for replica {self.replica_id}: stream cancelled "
                                        "(its channel was closed)") from None
        finally:
            call.cancel()

    # --- the background session -----------------------------------------------------------------------------

    async def run(self, on_epoch: Callable[[EpochView], None], stop: asyncio.Event, *,
                  register: bool = True, step: Callable[[], int] = lambda: 0,
                  on_lost: Callable[[str], None] | None = None, known_epoch: int = 0) -> None:
        """Heartbeat and watch until ``stop`` is set. ``register=False`` only watches (non-leader ranks).

        ``on_lost`` is told when the lighthouse no longer knows this incarnation (declared dead); the session
        then registers again as a new member. When a newer incarnation of the same replica id replaced this one,
        ``on_lost`` is told too and heartbeats stop (this process is superseded).
        """
        latest = {"n": known_epoch}

        def deliver(e: EpochView) -> None:
            if e.number > latest["n"]:
                latest["n"] = e.number
                on_epoch(e)

        tasks = [asyncio.create_task(self._watch_loop(deliver, latest, stop))]
        if register:
            tasks.append(asyncio.create_task(self._heartbeat_loop(step, latest, stop, on_lost, deliver)))
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_loop(self, deliver: Callable[[EpochView], None], latest: dict[str, int],
                          stop: asyncio.Event) -> None:
        backoff = Backoff()
        while not stop.is_set():
            try:
                async for e in self.watch(after_epoch=latest["n"]):
                    backoff.reset()
                    deliver(e)
            except LighthouseError as e:
                log.debug("watch replica=%s broke: %s", self.replica_id, e)
            await backoff.wait(stop)

    async def _heartbeat_loop(self, step: Callable[[], int], latest: dict[str, int], stop: asyncio.Event,
                              on_lost: Callable[[str], None] | None, deliver: Callable[[EpochView], None]) -> None:
        backoff = Backoff()
        while not stop.is_set():
            try:
                await self.heartbeat(step(), latest["n"])
                backoff.reset()
                wait = self.heartbeat_interval_s
            except FencedOut as e:
                # A newer incarnation of this replica registered: this process is superseded. Registering
                # again would declare the newer one dead, and the two would evict each other forever.
                log.warning("replica=%s incarnation %s was replaced (%s); heartbeats stop", self.replica_id,
                            self.incarnation, e)
                if on_lost is not None:
                    on_lost(str(e))
                return
            except UnknownTarget as e:
                log.warning("replica=%s lost its registration (%s); registering again", self.replica_id, e)
                if on_lost is not None:
                    on_lost(str(e))
                try:
                    reg = await self.register()
                    deliver(reg.epoch)
                    wait = self.heartbeat_interval_s
                except LighthouseError as e2:
                    log.warning("replica=%s re-register failed: %s", self.replica_id, e2)
                    wait = backoff.next()
            except LighthouseError as e:
                (log.warning if isinstance(e, Unauthenticated) else log.debug)(
                    "heartbeat replica=%s failed: %s", self.replica_id, e)
                wait = backoff.next()
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass


class Backoff:
    """Jittered exponential backoff, 50 ms to 2 s."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first, self.cap, self.current = first, cap, first

    def reset(self) -> None:
        self.current = self.first

    def next(self) -> float:
        delay = self.current * random.uniform(0.5, 1.0)
        self.current = min(self.cap, self.current * 2)
        return delay

    async def wait(self, stop: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(stop.wait(), self.next())
        except asyncio.TimeoutError:
            pass


class LighthouseClient:
    """Thread-backed client for the training process: calls block the caller at most ``timeout`` seconds;
    heartbeats and the epoch watch run on a private event-loop thread.

    Pushed epochs reach ``on_epoch`` (called on that thread: keep it short) and ``wait_epoch``.
    """

    def __init__(self, addresses: str | Sequence[str], job_id: str, replica_id: str, *, shard_count: int = 1,
                 endpoints: m.Endpoints = m.Endpoints(), rpc_timeout_s: float = 2.0,
                 on_epoch: Callable[[EpochView], None] | None = None,
                 on_lost: Callable[[str], None] | None = None, incarnation: str | None = None,
                 security: ClientSecurity | None = None) -> None:
        self._on_epoch = on_epoch
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._latest: EpochView | None = None
        self._step = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-{replica_id}", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._session: concurrent.futures.Future[None] | None = None
        self.rpc_timeout_s = rpc_timeout_s
        # The channel is made lazily, on the loop thread, by the first call.
        self.aio = AsyncLighthouseClient(addresses, job_id, replica_id, shard_count=shard_count,
                                         endpoints=endpoints, rpc_timeout_s=rpc_timeout_s, incarnation=incarnation,
                                         security=security)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout if timeout is not None else self.rpc_timeout_s + 1.0)
        except TimeoutError:
            fut.cancel()
            raise LighthouseUnavailable("lighthouse call did not finish within its deadline") from None

    @property
    def replica_id(self) -> str:
        return self.aio.replica_id

    @property
    def incarnation(self) -> str:
        return self.aio.incarnation

    def _deliver(self, e: EpochView) -> None:
        with self._cond:
            if self._latest is not None and e.number <= self._latest.number:
                return
            self._latest = e
            self._cond.notify_all()
        if self._on_epoch is not None:
            self._on_epoch(e)

    def start(self, register: bool = True, deadline_s: float = 30.0) -> Registration | None:
        """Register (retrying until ``deadline_s``) and start heartbeats and the watch.

        With ``register=False`` only the watch runs (ranks other than the replica's leader).
        """
        if self._session is not None:
            raise RuntimeError("LighthouseClient.start() called twice")
        reg: Registration | None = None
        if register:
            reg = self._run(self._register_until(deadline_s), timeout=deadline_s + 1.0)
            if reg.epoch.number:
                self._deliver(reg.epoch)
        # Made here, not inside the session coroutine, so that a close() right after start() always finds it
        # (an asyncio.Event binds to the loop that first waits on it).
        stop = self._stop = asyncio.Event()

        async def session() -> None:
            await self.aio.run(self._deliver, stop, register=register,
                               step=lambda: self._step, on_lost=self._on_lost,
                               known_epoch=self._latest.number if self._latest else 0)

        self._session = asyncio.run_coroutine_threadsafe(session(), self._loop)
        return reg

    async def _register_until(self, deadline_s: float) -> Registration:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        backoff = Backoff()
        while True:
            try:
                return await self.aio.register()
            except LighthouseUnavailable:
                if loop.time() + backoff.current > end:
                    raise
                await asyncio.sleep(backoff.next())  # retry pacing, bounded by the deadline

    def set_step(self, step: int) -> None:
        """Reported with the next heartbeat (informational)."""
        self._step = step

    @property
    def epoch(self) -> EpochView | None:
        with self._cond:
            return self._latest

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        """Wait until an epoch numbered above ``after`` is known; None at the deadline."""
        with self._cond:
            self._cond.wait_for(lambda: self._latest is not None and self._latest.number > after, timeout)
            return self._latest if self._latest is not None and self._latest.number > after else None

    def report_failure(self, suspect: str, epoch: int, reason: str) -> ReportResult:
        return self._run(self.aio.report_failure(suspect, epoch, reason))

    def ready(self, role: str) -> int:
        return self._run(self.aio.ready(role))

    def leave(self, reason: str = "") -> int:
        return self._run(self.aio.leave(reason))

    def status(self) -> pb.StatusResponse:
        return self._run(self.aio.status())

    def close(self, leave: str | None = None) -> None:
        """Stop the session and the loop thread (idempotent). With ``leave``, leave the job gracefully with that
        reason once heartbeats have stopped (so the session cannot register again behind our back)."""
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._session is not None:
            try:
                self._session.result(timeout=5)
            except Exception:
                pass
        if leave is not None:
            try:
                self._run(self.aio.leave(leave))
            except LighthouseError as e:
                log.info("replica=%s leave not acknowledged: %s", self.replica_id, e)
        try:
            self._run(self.aio.close(), timeout=5)
        except LighthouseError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
