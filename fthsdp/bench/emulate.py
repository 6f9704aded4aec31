"""Emulated replica groups: the control plane of N replica groups (register, one session each: heartbeats up,
epochs down) with no compute, in one process on one event loop. Each group has ``ranks`` ranks: its session's
holder (rank 0) hands every epoch to the others inside the group, as the runtime's group leader does, so the
lighthouse holds one connection and one stream per group whatever the ranks. Users smoke-test a deployment with
it; the benchmark loads the lighthouse with it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from lighthouse import membership as m
from lighthouse.backoff import Backoff
from lighthouse.client_rpc import ReportResult
from lighthouse.client_session import AsyncLighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.errors import Busy, LighthouseError, LighthouseUnavailable, UnknownTarget
from lighthouse.security import ClientSecurity
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc

log = logging.getLogger("fthsdp.emulate")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, and what exists at the end moved out of its sight
    (``gc.freeze``). One heap holds every emulated replica's client, so a collection walks them all: 2 s of
    collections, up to 0.5-1.1 s each, while 5,000-10,000 groups start or an epoch reaches them (measured), which a real
    replica, alone in its process with a heap of its own, never pays. The benchmark measures the lighthouse, so the
    emulator keeps its collector out of the way while it measures."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


class _OwnConnectionClient(AsyncLighthouseClient):
    """An emulated replica's client on its own TCP connection. gRPC otherwise multiplexes every channel to the
    same target over one shared connection (its global subchannel pool): thousands of emulated replicas would
    share one HTTP/2 connection, which no real deployment does and which breaks down near 2,000 of them."""

    def _stub_now(self) -> Any:
        if self._stub is None:
            self._channel = self.security.channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
            self._stub = pb_grpc.LighthouseStub(self._channel)
        return self._stub


@dataclass
class EmulatedReplica:
    client: AsyncLighthouseClient
    ranks: int = 1
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    epoch: EpochView | None = None
    rank_epochs: list[EpochView | None] = field(default_factory=list)
    """The epoch each of the group's other ranks holds (handed on by rank 0)."""
    received: dict[int, float] = field(default_factory=dict)
    """epoch number -> time.time() it reached every rank of this group."""

    @property
    def replica_id(self) -> str:
        return self.client.replica_id


class Emulator:
    """N emulated replicas of one job against one lighthouse (address list allowed)."""

    def __init__(self, lighthouse: str, replicas: int, *, job_id: str = "default", prefix: str = "emu",
                 shard_count: int = 1, on_epoch: Callable[[EmulatedReplica, EpochView], None] | None = None,
                 rpc_timeout_s: float = 5.0, security: ClientSecurity | None = None, ranks: int = 1) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.on_epoch = on_epoch
        self.ranks = ranks
        self.evicted = 0
        """Live emulated replicas the lighthouse declared dead (healthy ones evicted: each came back as a new
        incarnation)."""
        self._background: set[asyncio.Task[None]] = set()
        self._client_args = (lighthouse, job_id)
        self._client_kw: dict[str, Any] = {"shard_count": shard_count, "rpc_timeout_s": rpc_timeout_s,
                                           "security": security}
        self.replicas = [EmulatedReplica(self._client(f"{prefix}-{i:05d}"), ranks) for i in range(replicas)]

    def _client(self, replica_id: str) -> AsyncLighthouseClient:
        return _OwnConnectionClient(*self._client_args, replica_id, **self._client_kw)

    def _deliver(self, r: EmulatedReplica) -> Callable[[EpochView], None]:
        def deliver(e: EpochView) -> None:
            r.epoch = e
            r.rank_epochs[:] = [e] * (r.ranks - 1)  # rank 0 hands it on inside the group
            r.received.setdefault(e.number, time.time())
            me = e.member(r.replica_id)
            if me is not None and me.role == m.JOINING:
                # Nothing to fetch: an emulated joiner is caught up as soon as it is in the data plane.
                self._spawn(self._ready(r, m.ACTIVE))
            if self.on_epoch is not None:
                self.on_epoch(r, e)
        return deliver

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._background.discard)

    async def _ready(self, r: EmulatedReplica, role: str) -> None:
        try:
            await r.client.ready(role)
        except LighthouseError as e:
            log.info("ready(%s) for %s: %s", role, r.replica_id, e)

    async def _join(self, r: EmulatedReplica) -> None:
        """Enter the data plane as a joiner. The lighthouse lets one joiner sync at a time and answers the others
        Busy, and a re-registration may not have landed yet (UnknownTarget): retry those until stopped."""
        backoff = Backoff(first=0.05, cap=1.0)
        while not r.stop.is_set():
            try:
                await r.client.ready(m.JOINING)
                return
            except (Busy, UnknownTarget, LighthouseUnavailable) as e:
                log.debug("ready(joining) for %s: %s; retrying", r.replica_id, e)
            except LighthouseError as e:
                log.info("ready(joining) for %s: %s", r.replica_id, e)
                return
            await backoff.wait(r.stop)

    async def start(self, concurrency: int = 64, sessions_after: bool = False) -> None:
        """Register everyone (bounded concurrency), then start their sessions. Joiners declare themselves
        ready at once, and active once they are in an epoch. ``sessions_after``: start every session (heartbeats,
        watch) only once all have registered, so that thousands of registrations do not compete with the
        heartbeats of the first ones (the heartbeat timeout must then outlast the registrations)."""
        sem = asyncio.Semaphore(concurrency)
        roles: dict[str, str] = {}

        def begin(r: EmulatedReplica, role: str) -> None:
            self._start_session(r)
            if role == m.JOINING:
                self._spawn(self._join(r))  # in the background: it may wait for other joiners

        async def reg(r: EmulatedReplica) -> None:
            async with sem:
                role = (await r.client.register()).role
            if sessions_after:
                roles[r.replica_id] = role
            else:
                # Heartbeat from now on: waiting for everyone else to register first could outlast the timeout.
                begin(r, role)

        with collector_paused():
            await asyncio.gather(*(reg(r) for r in self.replicas))
            for r in self.replicas:
                if r.replica_id in roles:
                    begin(r, roles[r.replica_id])

    def _start_session(self, r: EmulatedReplica) -> None:
        def lost(why: str) -> None:
            # Declared dead while alive: the lighthouse never takes this incarnation back, so come back as a new
            # one, as a real replica group does (it exits 75 and its launcher restarts it).
            log.info("%s lost (%s): restarting as a new incarnation", r.replica_id, why)
            self.evicted += 1
            self._spawn(self._come_back(r))

        r.task = asyncio.create_task(r.client.run(self._deliver(r), r.stop, on_lost=lost, ranks=r.ranks))

    async def _come_back(self, r: EmulatedReplica) -> None:
        await self.kill(r)
        if r in self.replicas:  # not replaced already
            await self.restart(r)

    async def kill(self, r: EmulatedReplica) -> None:
        """Stop heartbeating and watching, and close the connection, as a SIGKILLed replica group would (its
        kernel closes its connection at once: the lighthouse sees its session end)."""
        r.stop.set()
        if r.task is not None:
            await asyncio.gather(r.task, return_exceptions=True)
        await r.client.close()

    async def restart(self, dead: EmulatedReplica) -> EmulatedReplica:
        """A new incarnation of a killed replica (same id): it registers, joins, and turns active as soon as it
        is in the data plane (as a restarted replica group would, with an instant catch-up)."""
        if not dead.stop.is_set():
            raise ValueError(f"{dead.replica_id} is alive: kill it first")
        r = EmulatedReplica(self._client(dead.replica_id), dead.ranks)
        self.replicas[self.replicas.index(dead)] = r
        role = (await r.client.register()).role
        self._start_session(r)
        if role == m.JOINING:
            self._spawn(self._join(r))
        return r

    async def report(self, reporter: EmulatedReplica, suspect: EmulatedReplica) -> ReportResult | None:
        epoch = reporter.epoch.number if reporter.epoch else 0
        try:
            return await reporter.client.report_failure(suspect.replica_id, epoch, "emulated collective failure")
        except LighthouseError as e:
            log.info("report by %s about %s: %s", reporter.replica_id, suspect.replica_id, e)
            return None

    def alive(self) -> list[EmulatedReplica]:
        return [r for r in self.replicas if not r.stop.is_set()]

    async def wait_all_have(self, predicate: Callable[[EpochView], bool], timeout: float) -> bool:
        """Wait until every live emulated replica holds an epoch matching ``predicate``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        # Replicas share their epoch views (memoized by content), so the predicate runs once per distinct view (the
        # view is kept with its verdict, so that its id is not reused). A poll resumes at the first replica that did
        # not match at the previous one, and a full pass confirms at the end: polling costs O(N) per epoch, not per
        # poll, so that it does not load the emulator, which reads the epochs (delivery times are recorded as each
        # epoch arrives, not here). The poll period grows with N.
        verdicts: dict[int, tuple[EpochView, bool]] = {}

        def holds(r: EmulatedReplica) -> bool:
            e = r.epoch
            if r.stop.is_set():
                return True
            if e is None:
                return False
            seen = verdicts.get(id(e))
            if seen is None:
                seen = verdicts[id(e)] = (e, predicate(e))
            return seen[1]

        period = max(0.01, len(self.replicas) / 200_000)
        first = 0
        while loop.time() < end:
            replicas = self.replicas
            while first < len(replicas) and holds(replicas[first]):
                first += 1
            if first >= len(replicas):
                if all(holds(r) for r in self.replicas):
                    return True
                first = 0
            await asyncio.sleep(period)  # polling a condition with a deadline
        return False

    async def close(self, leave: str | None = None) -> None:
        """Stop every session; with ``leave``, the live ones then leave the job (after their heartbeats stopped,
        so none registers again)."""
        live = self.alive()
        for r in self.replicas:
            r.stop.set()
        await asyncio.gather(*(r.task for r in self.replicas if r.task), return_exceptions=True)
        if leave is not None:
            await asyncio.gather(*(r.client.leave(leave) for r in live), return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas), return_exceptions=True)


async def run_emulate(lighthouse: str, replicas: int, job_id: str, prefix: str, stop: asyncio.Event,
                      security: ClientSecurity | None = None, ranks: int = 1) -> None:
    """``fthsdp emulate``: keep N replicas alive, print each epoch change once, until ``stop``."""
    printed: set[int] = set()

    def on_epoch(r: EmulatedReplica, e: EpochView) -> None:
        if e.number not in printed:
            printed.add(e.number)
            mine = sum(1 for x in e.members if x.replica_id.startswith(prefix + "-"))
            active = sum(1 for x in e.members if x.role == m.ACTIVE)
            print(f"epoch {e.number}: {len(e.members)} members ({active} active, {mine} emulated here) "
                  f"reason: {e.reason[:160]}", flush=True)

    emu = Emulator(lighthouse, replicas, job_id=job_id, prefix=prefix, on_epoch=on_epoch, security=security,
                   ranks=ranks)
    await emu.start()
    print(f"{replicas} emulated replicas registered with {lighthouse} (job {job_id}); Ctrl-C to stop", flush=True)
    try:
        await stop.wait()
    finally:
        await emu.close(leave="emulator stopped")
