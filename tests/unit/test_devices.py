"""Every thread that may touch CUDA sets its device (ftar.devices): checked on the source (no ``threading.Thread``
outside the helper; every start names its device) and with a fake ``torch.cuda`` whose current device is per
thread, as CUDA's is (docs/gpu.md "NCCL semantics")."""

from __future__ import annotations

import ast
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ftar import FTARConfig, LaneEngine, NoEpoch
from ftar import devices as devices_mod
from ftar.group import Reaper, _configure

from .test_ftar_api import NoMembership

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCOPE = ("ftar", "fthsdp/runtime", "fthsdp/catchup")
HELPER = "ftar/devices.py"


def unsafe_threads(source: str, path: str) -> list[str]:
    """Where ``source`` starts a thread without the helper, or calls the helper without naming the device."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("Thread", "ThreadPoolExecutor", "Timer") and path != HELPER:
            out.append(f"{path}:{node.lineno}: {name}(...) instead of ftar.devices.start_thread")
        if name == "start_thread" and not any(k.arg == "device" for k in node.keywords):
            out.append(f"{path}:{node.lineno}: start_thread without device=")
    return out


def test_every_thread_goes_through_the_device_helper() -> None:
    bad = []
    for folder in SCOPE:
        for p in (ROOT / folder).rglob("*.py"):
            rel = str(p.relative_to(ROOT))
            bad += unsafe_threads(p.read_text(), rel)
    assert not bad, bad


def test_the_source_check_can_fail() -> None:
    assert unsafe_threads("import threading\nthreading.Thread(target=f).start()\n", "ftar/x.py")
    assert unsafe_threads("from threading import Thread\nThread(target=f)\n", "ftar/x.py")
    assert unsafe_threads("start_thread(f, name='x')\n", "ftar/x.py")
    assert not unsafe_threads("start_thread(f, name='x', device=None)\n", "ftar/x.py")


# --- a fake torch.cuda: the current device is per thread ------------------------------------------------------


class FakeCuda:
    def __init__(self) -> None:
        self.local = threading.local()
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def set_device(self, device: torch.device | int) -> None:
        index = device.index if isinstance(device, torch.device) else device
        assert index is not None
        self.local.index = index
        with self.lock:
            self.calls.append((threading.current_thread().name, index))

    def current_device(self) -> int:
        return int(getattr(self.local, "index", 0))  # a thread that never set it is on cuda:0

    def by_thread(self, prefix: str) -> list[int]:
        with self.lock:
            return [i for name, i in self.calls if name.startswith(prefix)]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(devices_mod, "side_stream", lambda device: None)  # no streams without CUDA
    yield fake


GPU1 = torch.device("cuda", 1)


def test_the_lane_worker_sets_the_device(cuda: FakeCuda) -> None:
    eng = LaneEngine(NoMembership(), 2, FTARConfig(backend="nccl", device=GPU1, epoch_wait_s=0.1))
    try:
        with pytest.raises(NoEpoch):
            eng.allreduce([torch.ones(1)]).wait(10)
        assert cuda.by_thread("ftar-lane2") == [1]
    finally:
        eng.close()


def test_the_device_defaults_to_the_creating_threads(cuda: FakeCuda) -> None:
    cuda.set_device(3)  # the main thread, as the runtime does
    eng = LaneEngine(NoMembership(), 0, FTARConfig(backend="nccl", epoch_wait_s=0.1))
    try:
        assert eng.device == torch.device("cuda", 3)
    finally:
        eng.close()


def test_the_connect_thread_builds_the_communicator_on_the_lanes_device(cuda: FakeCuda) -> None:
    seen: list[int] = []

    class PG:  # torchft's wrapper as ftar.group.configure_with_store drives it
        def abort(self, errored: bool = True) -> None:
            pass

        def _create_pg(self, *args: Any) -> object:
            seen.append(torch.cuda.current_device())  # what torchft's _create_pg connects the communicator to
            return object()

    _configure(PG(), "prefix", "r0", 0, 2, 0, Reaper(0, GPU1), lambda: False)
    assert seen == [1]
    assert cuda.by_thread("ftar-connect-lane0") == [1]


def test_a_release_thread_sets_the_device(cuda: FakeCuda) -> None:
    aborted_on: list[int] = []

    class PG:
        def abort(self, errored: bool = True) -> None:
            aborted_on.append(torch.cuda.current_device())

    reaper = Reaper(4, GPU1)
    reaper.reap(PG())
    reaper.join(10)
    assert aborted_on == [1] and cuda.by_thread("ftar-reap-lane4") == [1]


def test_a_cpu_thread_never_touches_cuda(cuda: FakeCuda) -> None:
    done = threading.Event()
    devices_mod.start_thread(done.set, name="cpu-only", device=None).join(10)
    devices_mod.start_thread(lambda: None, name="gloo", device=torch.device("cpu")).join(10)
    assert done.is_set() and cuda.calls == []


# --- streams: one of its own per thread ---------------------------------------------------------------------------


class FakeStreams:
    """torch's stream pool: ``Stream()`` hands out ``size`` streams in turn (torch's has 32 per priority)."""

    def __init__(self, size: int) -> None:
        self.size, self.next = size, 0
        self.current = threading.local()

    def Stream(self, device: torch.device) -> Any:  # noqa: N802 (torch's name)
        handle, self.next = self.next % self.size, self.next + 1
        return type("S", (), {"cuda_stream": handle, "device": device})()

    def set_stream(self, stream: Any) -> None:
        self.current.stream = stream


def test_each_thread_keeps_a_stream_no_other_thread_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the snapshot thread took a new pool stream for every snapshot, and after a few it shared the lane's."""
    pool = FakeStreams(4)
    monkeypatch.setattr(torch.cuda, "Stream", pool.Stream)
    monkeypatch.setattr(torch.cuda, "set_stream", pool.set_stream)
    gpu = torch.device("cuda", 0)
    lane_stream: list[Any] = []
    release, taken = threading.Event(), threading.Event()

    def lane() -> None:
        lane_stream.append(devices_mod.side_stream(gpu))
        taken.set()
        release.wait(10)

    t = devices_mod.start_thread(lane, name="lane", device=None)
    assert taken.wait(10)
    mine = [devices_mod.side_stream(gpu) for _ in range(3 * pool.size)]  # a snapshot thread, many snapshots
    assert len({s.cuda_stream for s in mine}) == 1 and mine[0].cuda_stream != lane_stream[0].cuda_stream
    release.set()
    t.join(10)
    devices_mod._release_stream()


def test_a_finished_threads_stream_is_free_again(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = FakeStreams(1)  # one stream in the pool
    monkeypatch.setattr(torch.cuda, "Stream", pool.Stream)
    monkeypatch.setattr(torch.cuda, "set_stream", pool.set_stream)
    gpu = torch.device("cuda", 0)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        devices_mod.side_stream(gpu)
        taken.set()
        release.wait(10)

    holder = devices_mod.start_thread(hold, name="holder", device=None)
    assert taken.wait(10)
    with pytest.raises(RuntimeError, match="another fthsdp thread"):
        devices_mod.side_stream(gpu)  # the only stream is held
    release.set()
    holder.join(10)
    assert devices_mod.side_stream(gpu).cuda_stream == 0  # given back when its thread ended
    devices_mod._release_stream()


def test_received_memory_is_kept_for_the_receiving_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result allocated on the lane's stream and used on the trainer's: the allocator must not reuse it for the
    lane's next buffers while the trainer's stream still reads it."""
    log: list[object] = []

    class CudaTensor:
        is_cuda = True

        def record_stream(self, stream: object) -> None:
            log.append(("kept for", stream))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "trainer's stream")
    monkeypatch.setattr(devices_mod, "wait_for", lambda event: log.append(("waits for", event)))
    devices_mod.receive("result event", [CudaTensor(), torch.ones(1)])  # type: ignore[list-item]
    assert log == [("waits for", "result event"), ("kept for", "trainer's stream")]
