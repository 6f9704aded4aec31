"""The lighthouse's RPCs from one replica, on the caller's event loop (``LighthouseRpc``): every call has a
deadline; an UNAVAILABLE moves on to the next lighthouse address, or straight to the leader a follower named
(trailing metadata ``fthsdp-leader``, HA on etcd). gRPC status codes become typed errors (``lighthouse.errors``).
TLS and the job token come in a ``ClientSecurity``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import grpc

from lighthouse.ejection import HELD_OUT
from lighthouse.epoch_view import EpochView
from lighthouse.errors import (
    AtCapacity,
    Busy,
    FencedOut,
    HeldOut,
    InvalidRequest,
    JobOver,
    LighthouseError,
    LighthouseUnavailable,
    NotLeader,
    Unauthenticated,
    UnknownTarget,
)
from lighthouse.incarnations import finished_step_of
from lighthouse.model import ACTIVE, JOINING, NO_SLOT, Endpoints
from lighthouse.proto_codec import (
    ROLE_FROM_PB,
    ROLE_TO_PB,
    endpoints_to_pb,
    epoch_from_pb,
)
from lighthouse.security import LEADER_METADATA, ClientSecurity
from lighthouse.stragglers import Pace, pack_lanes
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from lighthouse.validate import REASON_MAX

log = logging.getLogger("fthsdp.lighthouse.client")
NO_ENDPOINTS = Endpoints()

_ERRORS: dict[grpc.StatusCode, type[LighthouseError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AtCapacity,
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


def _leader_hint(e: grpc.aio.AioRpcError) -> str | None:
    """The leader a follower named in its refusal (None: not a follower's refusal; '': no leader known)."""
    try:
        # grpc's Metadata iterates (key, value) pairs (its stubs call it a Mapping).
        md = cast(Iterable[tuple[str, str | bytes]], e.trailing_metadata() or ())
    except Exception:
        return None
    for key, value in md:
        if key == LEADER_METADATA:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def translate_error(e: grpc.aio.AioRpcError, what: str) -> LighthouseError:
    code = e.code()
    hint = _leader_hint(e) if code == grpc.StatusCode.UNAVAILABLE else None
    if hint is not None:
        return NotLeader(f"{what}: {code.name}: {e.details()}", hint)
    cls = _ERRORS.get(code, LighthouseUnavailable)
    if code == grpc.StatusCode.ABORTED and (e.details() or "").startswith(HELD_OUT):
        cls = HeldOut
    message = f"{what}: {code.name}: {e.details()}"
    if code == grpc.StatusCode.FAILED_PRECONDITION and (step := finished_step_of(e.details() or "")) is not None:
        return JobOver(message, step)
    return cls(message)


def cancelled_by_grpc() -> bool:
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
    finished: bool = False
    """The job completed (a member left "finished"): this replica was NOT registered and must not train; it stops
    with the job's final state (e.g. the final checkpoint of ``finished_step``)."""
    finished_step: int = 0
    """The step the job completed at (0 unless ``finished``)."""


@dataclass(frozen=True)
class ReportResult:
    confirmed: bool
    detail: str
    epoch: int


class LighthouseRpc:
    """One replica's calls to the lighthouse, on the caller's event loop."""

    def __init__(self, addresses: str | Sequence[str], job_id: str, replica_id: str, *, shard_count: int = 1,
                 endpoints: Endpoints = NO_ENDPOINTS, incarnation: str | None = None,
                 rpc_timeout_s: float = 2.0, security: ClientSecurity | None = None, slot: int = NO_SLOT,
                 slots: int = 0, layout: str = "") -> None:
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
        self.digest: tuple[int, str] = (0, "")
        """(step, hex digest) of the replica's latest state digest, sent with every heartbeat (informational)."""
        self.pace: Pace | None = None
        """The replica's latest pace report, sent with every heartbeat (fail-slow evidence)."""
        self.slot, self.slots = slot, slots
        self.layout = layout
        """This replica's parallel layout, as its device mesh names it ('': none named)."""
        """The data slot a registration asks for (the one held in the newest epoch, once in one; ``NO_SLOT``: none,
        a spare) and the job's slot count (0: none named; ``lighthouse.slots``)."""
        self.role = ""
        self.in_data_plane = False
        """A joiner: the lighthouse accepted its Ready(JOINING)."""
        self.member_of = 0
        """The newest epoch seen with this incarnation in it (0: none yet)."""
        self.dropped_from = 0
        """A newer epoch seen without it after that (0: none): the lighthouse dropped it, it is over for good."""
        self.active_wanted = False
        """Ready(ACTIVE) was asked for: the session retries it until the lighthouse takes it (``active_pending``)."""
        self.heartbeats = 0
        """Heartbeats sent (unary ones the lighthouse accepted; on a session, every one written)."""
        self.update_bytes = 0
        """Bytes of the epoch updates received on sessions (a benchmark's bytes per epoch change)."""
        self.errors: collections.Counter[str] = collections.Counter()
        """Failed calls and broken streams, by gRPC status code name (a benchmark counts the CANCELLED ones)."""
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.LighthouseStub | None = None

    # --- connection -------------------------------------------------------------------------------------

    def _stub_now(self) -> pb_grpc.LighthouseStub:
        if self._stub is None:
            self._channel = self.security.channel(self.addresses[self._index % len(self.addresses)])
            self._stub = pb_grpc.LighthouseStub(self._channel)  # type: ignore[no-untyped-call]
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

    async def _call(self, method: str, request: object) -> object:
        for attempt in (1, 2):  # a second, at once, only after a redirect to the named leader
            stub = self._stub_now()
            channel = self._channel
            try:
                return await getattr(stub, method)(request, timeout=self.rpc_timeout_s,
                                                   metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                self.errors[e.code().name] += 1
                err = translate_error(e, f"{method} for replica {self.replica_id} at {self.address}")
                if isinstance(err, LighthouseUnavailable):
                    moved = await self._rotate(channel, err.leader if isinstance(err, NotLeader) else "")
                    if moved and attempt == 1:
                        continue
                raise err from None
            except asyncio.CancelledError:
                if not cancelled_by_grpc():
                    raise
                raise LighthouseUnavailable(f"{method} for replica {self.replica_id}: call cancelled "
                                            "(its channel was closed)") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel = self._stub = None

    # --- calls --------------------------------------------------------------------------------------------

    def saw(self, epoch: EpochView) -> None:
        """Keep track of whether this incarnation was dropped: in one epoch, absent from a newer one."""
        me = epoch.member(self.replica_id)
        if me is not None and me.incarnation == self.incarnation:
            if self.slots and epoch.number >= self.member_of:
                self.slot = me.slot  # a registration again (a lighthouse that lost it) asks for what it holds
            self.member_of = max(self.member_of, epoch.number)
        elif self.member_of and epoch.number > self.member_of and not self.dropped_from:
            self.dropped_from = epoch.number

    @property
    def held_role(self) -> str:
        """The role this incarnation holds, as a re-registration claims it: ACTIVE (also while Ready(ACTIVE) is
        pending: the runtime trains as active from then on), JOINING once in the data plane, else ''."""
        if self.role == ACTIVE or self.active_wanted:
            return ACTIVE
        return JOINING if self.in_data_plane else ""

    @property
    def active_pending(self) -> bool:
        """Ready(ACTIVE) was asked for and the lighthouse has not taken it yet."""
        return self.active_wanted and self.role != ACTIVE

    async def register(self, claim: str = "", last_epoch: int = 0) -> Registration:
        """Register; ``claim`` and ``last_epoch`` only when registering this incarnation again with a lighthouse
        that lost it (``held_role``, the newest epoch seen)."""
        resp = await self._call("Register", pb.RegisterRequest(
            job_id=self.job_id, replica_id=self.replica_id, shard_count=self.shard_count,
            incarnation=self.incarnation, role=ROLE_TO_PB[claim] if claim else pb.ROLE_UNSPECIFIED,
            last_epoch=last_epoch, endpoints=endpoints_to_pb(self.endpoints),
            slot=None if self.slot == NO_SLOT else self.slot, slots=self.slots, layout=self.layout))
        assert isinstance(resp, pb.RegisterResponse)
        self.role = ROLE_FROM_PB.get(resp.role, JOINING)
        self.heartbeat_interval_s = resp.heartbeat_interval_s or self.heartbeat_interval_s
        return Registration(resp.incarnation, self.role, epoch_from_pb(resp.epoch),
                            resp.heartbeat_interval_s, resp.heartbeat_timeout_s, resp.resume,
                            finished=resp.finished, finished_step=resp.finished_step)

    def _heartbeat_pb(self, step: int, epoch: int) -> pb.HeartbeatRequest:
        digest_step, digest = self.digest
        pace = self.pace
        return pb.HeartbeatRequest(
            job_id=self.job_id, replica_id=self.replica_id, incarnation=self.incarnation, step=step, epoch=epoch,
            digest_step=digest_step, digest=digest, pace_step=pace.step if pace else 0,
            compute_s=pace.compute_s if pace else 0.0, wait_s=pace.wait_s if pace else 0.0,
            busiest_rank=pace.busiest_rank if pace else 0, busiest_s=pace.busiest_s if pace else 0.0,
            siblings_busy_s=pace.siblings_busy_s if pace else 0.0,
            lane_wait_ms=pack_lanes(pace.lane_wait_s) if pace else b"")

    async def heartbeat(self, step: int = 0, epoch: int = 0) -> int:
        """One unary heartbeat, with the step, the epoch, the latest state digest (``digest``) and pace (``pace``);
        for a lighthouse without sessions (``session`` carries heartbeats otherwise)."""
        resp = await self._call("Heartbeat", self._heartbeat_pb(step, epoch))
        assert isinstance(resp, pb.HeartbeatResponse)
        self.heartbeats += 1
        return resp.epoch

    async def report_failure(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> ReportResult:
        """Blame ``suspect`` for a failure in ``epoch``. ``early``: before the blame grace ended, so the lighthouse
        acts on it only with evidence of the suspect's own (its connection closed, or its silence)."""
        resp = await self._call("ReportFailure", pb.FailureReport(
            job_id=self.job_id, reporter_replica_id=self.replica_id, reporter_incarnation=self.incarnation,
            suspect_replica_id=suspect, epoch=epoch, reason=reason[: REASON_MAX], early=early))
        assert isinstance(resp, pb.FailureReportResponse)
        return ReportResult(resp.confirmed, resp.detail, resp.epoch)

    async def ready(self, role: str, probe_s: float = 0.0) -> int:
        """Ready(``role``); JOINING with the seconds of a probe step (``probe_s``, 0: none). Asking for ACTIVE is
        remembered: if this call fails, the session retries it."""
        self.active_wanted = self.active_wanted or role == ACTIVE
        resp = await self._call("Ready", pb.ReadyRequest(job_id=self.job_id, replica_id=self.replica_id,
                                                         incarnation=self.incarnation, role=ROLE_TO_PB[role],
                                                         probe_compute_s=probe_s))
        assert isinstance(resp, pb.ReadyResponse)
        if role == ACTIVE:
            self.role = ACTIVE
        else:
            self.in_data_plane = True
        return resp.epoch

    async def leave(self, reason: str = "", step: int = 0) -> int:
        """Leave the job gracefully; ``step``: the last committed step (with reason "finished": the job's final
        step)."""
        resp = await self._call("Leave", pb.LeaveRequest(job_id=self.job_id, replica_id=self.replica_id,
                                                         incarnation=self.incarnation, reason=reason, step=step))
        assert isinstance(resp, pb.LeaveResponse)
        return resp.epoch

    async def status(self) -> pb.StatusResponse:
        resp = await self._call("Status", pb.StatusRequest(job_id=self.job_id))
        assert isinstance(resp, pb.StatusResponse)
        return resp
