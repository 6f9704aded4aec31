"""The in-process lighthouse the lighthouse tests run against (on a background event loop), gRPC call helpers,
and a deadline-bounded wait."""

from __future__ import annotations

import asyncio
import base64
import itertools
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from lighthouse import membership as m
from lighthouse.config import LighthouseConfig
from lighthouse.server.app import Lighthouse
from lighthouse.stores.base import Store
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc

T = TypeVar("T")

JOB = "default"
TOKEN = "s3cret-job-token-0123456789"
"""The job token of the security tests."""
# Fast liveness for tests: a missed heartbeat is noticed within ~0.8 s.
FAST_POLICY = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.8, confirm_age_s=0.3)
# For tests that drive heartbeats by hand and must not race the liveness check.
SLOW_POLICY = m.Policy(min_replicas=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0, confirm_age_s=10.0)


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)  # polling a condition with a deadline


class ServerThread:
    """A ``Lighthouse`` running on its own event loop in a background thread (no torch import: rendezvous off)."""

    def __init__(self, config: LighthouseConfig, store: Store | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-lighthouse", daemon=True)
        self.thread.start()
        self.lh = Lighthouse(config, store)
        try:
            self.call(self.lh.start())
        except BaseException:
            self._stop_loop()
            raise
        self.addr = f"127.0.0.1:{self.lh.port}"
        self.http = f"127.0.0.1:{self.lh.http_port}"
        self._stopped = False

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run a plain function on the server's loop (job state is only touched there)."""

        async def run() -> T:
            return fn()

        return self.call(run(), timeout)

    def state(self, job: str = JOB) -> m.State:
        return self.on_loop(lambda: self.lh.jobs[job].state)

    def number(self, job: str = JOB) -> int:
        return self.on_loop(lambda: self.lh.jobs[job].number)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.call(self.lh.stop(grace=0.2))
            self.call(self._cancel_leftovers())
        finally:
            self._stop_loop()

    @staticmethod
    async def _cancel_leftovers() -> None:
        """End what grpc left on the loop (handlers of cancelled streams), so closing it destroys nothing."""
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=2)


def make_config(policy: m.Policy = FAST_POLICY, **kw: Any) -> LighthouseConfig:
    kw.setdefault("bind", "127.0.0.1:0")
    kw.setdefault("http", "127.0.0.1:0")
    kw.setdefault("rendezvous", False)
    kw.setdefault("tick_s", 0.02)
    return LighthouseConfig(policy=policy, **kw)


_incarnations = itertools.count(1)


def register(stub: pb_grpc.LighthouseStub, replica_id: str, *, incarnation: str | None = None, job: str = JOB,
             shard_count: int = 1, **endpoints: str) -> pb.RegisterResponse:
    inc = incarnation or f"inc{next(_incarnations)}"
    return stub.Register(pb.RegisterRequest(job_id=job, replica_id=replica_id, incarnation=inc,
                                            shard_count=shard_count, endpoints=pb.Endpoints(**endpoints)),
                         timeout=5)


def heartbeat(stub: pb_grpc.LighthouseStub, replica_id: str, incarnation: str, job: str = JOB,
              step: int = 0, digest: tuple[int, str] = (0, ""),
              pace: tuple[int, float, float] = (0, 0.0, 0.0),
              lane_wait_ms: bytes = b"") -> pb.HeartbeatResponse:
    return stub.Heartbeat(pb.HeartbeatRequest(job_id=job, replica_id=replica_id, incarnation=incarnation,
                                              step=step, digest_step=digest[0], digest=digest[1], pace_step=pace[0],
                                              compute_s=pace[1], wait_s=pace[2], lane_wait_ms=lane_wait_ms), timeout=5)


def status(stub: pb_grpc.LighthouseStub, job: str = JOB) -> pb.StatusResponse:
    return stub.Status(pb.StatusRequest(job_id=job), timeout=5)


def https_get(addr: str, path: str, *, token: str | None = None, ctx: ssl.SSLContext | None = None,
              basic: str | None = None) -> tuple[int, str, dict[str, str]]:
    """GET from a lighthouse's HTTP side port (HTTPS with ``ctx``), with a Bearer token or HTTP Basic password."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if basic is not None:
        headers = {"Authorization": "Basic " + base64.b64encode(f"ops:{basic}".encode()).decode()}
    req = urllib.request.Request(f"{'https' if ctx else 'http'}://{addr}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)
