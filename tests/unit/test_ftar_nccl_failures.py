"""How an NCCL lane survives its peers' failures, on the CPU (docs/gpu.md §4): the real ``EpochGroup`` and lane engine
over a fake of torchft's NCCL group and c10d's backend, which fails the way NCCL does.

- an error at issue (a communicator aborted, or whose nonblocking init timed out after a member died) is the peers'
  failure, redone in the next epoch; it never reaches the caller as a ``RuntimeError``;
- an error at completion shows in c10d's ``get_error`` (the work's ``is_success`` is not implemented by
  ``ProcessGroupNCCL``) and fails the collective at once, not at the deadline;
- an abort by someone else (torchft's timer, c10d's watchdog) while a collective is pending lets the stream run on
  over a half-reduced buffer, and the next collective of the exchange fails at issue: redone, never read;
- the event is read before the error state, so an abort between the two reads cannot pass garbage as done;
- the lane's groups are built with c10d's watchdog told to record errors only; the process's settings come first.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from ftar import FTARConfig, LaneEngine, nccl_env
from ftar import devices as devices_mod
from ftar import engine as engine_mod
from ftar import group as group_mod
from ftar.group import EpochGroup
from ftar.packing import Staging
from lighthouse.epoch_view import EpochView

from .test_ftar_completion import FakeMembership, FakeStore, epoch

WAITED: list[Work] = []
"""The work a lane's stream was last told to wait for (the event recorded next completes with it)."""
DESTROYED_ON: list[str] = []
"""The threads the fake backends were destroyed on."""


class Work:
    """An NCCL work: ``wait()`` orders the lane's stream after it and returns at once; ``done`` is the device's."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self) -> bool:
        WAITED.append(self)
        return True

    def is_success(self) -> bool:
        raise RuntimeError("ProcessGroupNCCL::WorkNCCL::isSuccess is not implemented")


class Event:
    """A CUDA event recorded behind ``work`` on the lane's stream; ``on_query`` runs before it answers."""

    def __init__(self, work: Work | None, on_query: Callable[[], None] = lambda: None) -> None:
        self.work, self.on_query = work, on_query

    def query(self) -> bool:
        self.on_query()
        return self.work is None or self.work.done.is_set()


class Backend:
    """c10d's ``ProcessGroupNCCL`` as Python sees it: the error its watchdog recorded."""

    def __init__(self) -> None:
        self.error = ErrorType.SUCCESS

    def get_error(self) -> ErrorType:
        return self.error

    def __del__(self) -> None:
        DESTROYED_ON.append(threading.current_thread().name)


class Base:
    def __init__(self) -> None:
        self.backend = Backend()

    def _get_backend(self, device: torch.device) -> Backend:
        return self.backend


class TorchftNccl:
    """torchft's ``ProcessGroupNCCL``: ``abort`` sets ``_errored`` first, then aborts the communicator (the stream
    runs on over whatever the collective left) and drops the backend. Data collectives (floating point) behave as
    ``script`` says; control collectives (int64) succeed (MAX: every member sent the same)."""

    def __init__(self, world: int, script: str) -> None:
        self.world, self.script = world, script
        self._errored: BaseException | None = None
        self._pg: Base | None = Base()
        self.pending: list[Work] = []
        self.issued = 0

    def abort(self, errored: bool = True) -> None:
        self._errored = RuntimeError("aborted")
        for w in self.pending:  # ncclCommAbort: the stream runs on
            w.done.set()
        self._pg = None

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        return self._done()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        if self._pg is None:
            raise dist.DistBackendError("NCCL communicator was aborted on rank 0")
        t = tensors[0]
        if self.script == "init-timeout":
            raise dist.DistBackendError("NCCL communicator init timed out (nonblocking): a member never joined")
        if not t.dtype.is_floating_point or self.script == "ok":
            if opts.reduceOp == dist.ReduceOp.SUM:
                t.mul_(self.world)
            return self._done()
        self.issued += 1
        t.mul_(self.world)
        t[0] = float("nan")  # half-reduced (one chunk was not): what the stream leaves when it runs on
        work = Work()
        self.pending.append(work)
        if self.script == "remote-error":  # the peer died: the kernel waits, the watchdog records the error
            assert self._pg is not None
            self._pg.backend.error = ErrorType.REMOTE_ERROR
        if self.script == "aborted-after-first" and self.issued == 1:
            self.abort()  # torchft's own timer (or c10d's watchdog) gave the communicator up
        return work

    def _done(self) -> Work:
        work = Work()
        work.done.set()
        return work


class Group(EpochGroup):
    """The real group over ``TorchftNccl``: epoch ``n``'s data collectives follow ``scripts[n]`` (default ok)."""

    scripts: dict[int, str] = {}
    fakes: list[TorchftNccl] = []

    @classmethod
    def open(cls, epoch: EpochView, replica_id: str, *args: Any) -> EpochGroup:  # type: ignore[override]
        pg = TorchftNccl(len(epoch.replica_ids), cls.scripts.get(epoch.number, "ok"))
        cls.fakes.append(pg)
        return cls(epoch, epoch.replica_ids.index(replica_id), FakeStore(), pg, Staging(torch.device("cpu")), "nccl")


@pytest.fixture
def lane(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Group]]:
    """The engine builds ``Group``s; events follow the works the lane's stream waits for."""
    monkeypatch.setattr(engine_mod, "EpochGroup", Group)
    monkeypatch.setattr(devices_mod, "record", lambda device: Event(WAITED[-1] if WAITED else None))
    monkeypatch.setattr(devices_mod, "wait_for", lambda event: None)
    Group.scripts, Group.fakes = {}, []
    WAITED.clear()
    DESTROYED_ON.clear()
    yield Group


CONFIG = FTARConfig(backend="gloo", timeout_s=10.0, blame_grace_s=0.05, epoch_wait_s=10.0, connect_timeout_s=1.0)


def exchange(membership: FakeMembership, config: FTARConfig = CONFIG,
             dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)) -> tuple[list[torch.Tensor], Any, float]:
    """One exchange (a buffer per dtype); the lighthouse re-forms epoch 2 once a peer is reported."""
    membership.on_report = lambda: membership.push(epoch(membership.epoch.number + 1, ("r0", "r1")))
    eng = LaneEngine(membership, 0, config)
    try:
        inputs = [torch.arange(6 - i, dtype=d) for i, d in enumerate(dtypes)]
        t0 = time.monotonic()
        result = eng.allreduce([t.clone() for t in inputs], tag=5).wait(30)
        return inputs, result, time.monotonic() - t0
    finally:
        eng.close(timeout=5)


def redone_intact(inputs: list[torch.Tensor], result: Any) -> None:
    assert result.epoch == 2 and result.attempts == 2
    assert all(torch.equal(a, b) for a, b in zip(result.tensors, inputs, strict=True))


def test_an_error_at_issue_is_a_peer_failure_redone_in_the_next_epoch(lane: type[Group]) -> None:
    """Before: the ``DistBackendError`` left the lane as the exchange's result and crashed the trainer's step."""
    lane.scripts = {1: "init-timeout"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    inputs, result, _ = exchange(m)
    redone_intact(inputs, result)
    assert m.reports == [("r1", 1)]


def test_an_error_at_completion_fails_at_once_not_at_the_deadline(lane: type[Group]) -> None:
    """The peer died: the kernel never completes, c10d's watchdog records a remote error. Before: the watcher asked
    the work's ``is_success()`` (which raises on NCCL), gave up asking, and waited for its 10 s deadline."""
    lane.scripts = {1: "remote-error"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    inputs, result, took = exchange(m)
    redone_intact(inputs, result)
    assert took < CONFIG.timeout_s / 2, f"found at the deadline ({took:.1f}s), not from the recorded error"
    assert m.reports == [("r1", 1)]


def test_an_abort_while_a_collective_is_pending_fails_the_next_issue_and_is_redone(lane: type[Group]) -> None:
    """torchft's timer aborted the communicator after the first buffer was issued: that buffer's stream runs on
    over a half-reduced buffer, the second buffer's issue raises. Before: the issue's error escaped."""
    lane.scripts = {1: "aborted-after-first"}
    m = FakeMembership(epoch(1, ("r0", "r1")))
    inputs, result, _ = exchange(m)
    redone_intact(inputs, result)
    assert lane.fakes[0].issued == 1 and lane.fakes[0]._errored is not None


def test_the_event_is_read_before_the_error_state(lane: type[Group], monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort lands between the watcher's two reads: it sets the error and lets the stream run on, so the event
    now completes over a half-reduced buffer. Read the error first and the event second, that passed as done."""
    lane.scripts = {1: "pending"}

    def record(device: torch.device) -> Event:
        work = WAITED[-1]
        pg = lane.fakes[-1]
        return Event(work, on_query=lambda: pg.abort() if not work.done.is_set() else None)

    monkeypatch.setattr(devices_mod, "record", record)
    m = FakeMembership(epoch(1, ("r0", "r1")))
    inputs, result, _ = exchange(m, dtypes=(torch.float32,))  # one buffer: nothing after it to notice the abort
    assert not any(t.isnan().any() for t in result.tensors), "a half-reduced buffer was taken as the result"
    redone_intact(inputs, result)


def test_the_backend_is_destroyed_on_a_reaper_thread_never_the_lanes(lane: type[Group]) -> None:
    """c10d's group destructor can block for a minute: the lane reads ``get_error`` without keeping the backend, and
    the reaper that aborts a group holds its last reference."""
    lane.scripts = {1: "remote-error"}
    inputs, result, _ = exchange(FakeMembership(epoch(1, ("r0", "r1"))))
    redone_intact(inputs, result)
    lane.fakes.clear()
    gc.collect()
    assert len(DESTROYED_ON) == 2 and all(n.startswith("ftar-reap") for n in DESTROYED_ON), DESTROYED_ON


def test_the_group_error_names_torchfts_flag_then_the_backends_then_this_lanes_abort() -> None:
    pg = TorchftNccl(2, "ok")
    group = EpochGroup(epoch(1, ("r0", "r1")), 0, FakeStore(), pg, Staging(torch.device("cpu")), "nccl")
    assert group.error() is None
    assert pg._pg is not None
    pg._pg.backend.error = ErrorType.COMM_ERROR
    assert "COMM_ERROR" in (group.error() or "")
    pg._errored = RuntimeError("aborted")
    assert group.error() == "group error: aborted"
    group.abort(group_mod.Reaper(0))
    assert group.error() == "aborted by this lane" and group.pg is None


# --- c10d's watchdog settings ------------------------------------------------------------------------------------


def test_a_lanes_group_is_built_with_the_watchdog_recording_errors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchft.process_group import ProcessGroupNCCL

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    env = {nccl_env.ASYNC_ERROR_HANDLING: "3", nccl_env.BLOCKING_WAIT: "0", nccl_env.NONBLOCKING_TIMEOUT: "10"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pg = ProcessGroupNCCL()
    seen: dict[str, str | None] = {}

    def create(store: Any, rank: int, world: int) -> object:  # where c10d reads them
        seen.update({k: os.environ.get(k) for k in nccl_env.LANE})
        return object()

    monkeypatch.setattr(pg, "_create_pg", create)
    group_mod.configure_with_store(pg, object(), "r0", 0, 2)
    assert seen == nccl_env.LANE  # the lane's group: no teardown, no blocking wait
    assert {k: os.environ.get(k) for k in env} == env  # the trainer's groups keep theirs


def test_the_process_settings_fill_in_and_never_override() -> None:
    environ: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = nccl_env.prepare_process(environ)
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                       "TORCH_NCCL_NONBLOCKING_TIMEOUT": "10", "TORCH_NCCL_BLOCKING_WAIT": "0"}
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert nccl_env.prepare_process(environ) == {}  # twice is once
    assert nccl_env.conflicts({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}) and not nccl_env.conflicts(environ)


def test_lane_settings_restore_what_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    environ: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    with nccl_env.lane_settings(environ):
        assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def test_every_rank_has_the_settings_before_init_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime puts them in the environment before it builds the replica's process group."""
    from fthsdp.runtime import core
    from fthsdp.runtime.config import RuntimeConfig

    environ = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL_")}
    monkeypatch.setattr(os, "environ", environ)
    seen: dict[str, str] = {}

    class Stop(Exception):
        pass

    def init(backend: str) -> None:
        seen.update({k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL_")})
        raise Stop

    monkeypatch.setattr(core.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(core.dist, "init_process_group", init)
    with pytest.raises(Stop):
        core.StepCore(RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=0, num_replicas=2, replica_id="r0",
                                    rank=0, world_size=1))
    assert seen == nccl_env.process_settings({})


def test_fthsdp_run_gives_every_rank_the_settings(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fthsdp run`` starts the ranks with them (a script that builds its groups before the runtime is safe too)."""
    from fthsdp.launch.config import ClusterConfig

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL_")})
    env = ClusterConfig(replicas=2).replica_env(1, "127.0.0.1:1", tmp_path / "p", tmp_path, None)
    wanted = nccl_env.process_settings({})
    assert {k: env.get(k) for k in wanted} == wanted
