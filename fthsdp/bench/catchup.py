"""``fthsdp bench catchup --mb N``: the catch-up transfer on a state large enough to time, and what serving it costs
the source's training (docs/design.md §6).

A source process trains the reference model (one thread, ``torch.set_num_threads(1)``, as every process of the
reference workload) and runs a catch-up server over a synthetic state of ``mb`` MB (float32 tensors of 4 MiB or
less; a replica's shards of a larger model, as far as the wire is concerned). Its training thread calls
``at_commit`` and ``before_update`` around each step like a replica's. The joiner (this process) fetches the
snapshot of the step after the one being trained, ``repeats`` times; between those, a plain loopback socket copy of
the same bytes between two processes (``fthsdp.bench.recovery.socket_copy_mbps``: no framing, no checksum) runs
``repeats`` times while the source trains, so both see the same load. Figures:

- ``transfer_ratio``: the best fetch's throughput (its manifest to its last byte, checksums included) over the
  best socket copy's;
- ``serve_step_ratio``: the source's median step while it serves (steps that overlap a fetch, its snapshot copy
  included) over its median step while nothing is transferred (after the warm-up: before the first copy, and
  ``QUIET_BETWEEN`` steps after each fetch, so that the baseline spans the run).

Pinned (the default where there are two cores or more; ``--no-pin`` not): the source's training thread has the
first core to itself, and everything else (the source's catch-up threads, the joiner, the socket copy's two
processes) shares the others. That stands for a real host, whose catch-up threads and the joiner's whole machine
are not on the core that drives the training; on 2 cores, unpinned, the joiner's receive and checksums and both
sides of the copy take turns with the training thread on the same two cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from fthsdp.bench.recovery import socket_copy_mbps
from fthsdp.bench.results import CatchupResult

JOB, INC, TOKEN = "bench", "inc-bench", "bench-token"
PIECE_FLOATS = 1 << 20
"""The synthetic state's tensors hold at most this many float32 (4 MiB each)."""
QUIET_BETWEEN = 3
"""Steps the source trains with nothing moving after each fetch (they count as steady, as do those before)."""


def synthetic_state(mb: float) -> list[tuple[str, torch.Tensor]]:
    """``mb`` MB of float32 tensors (4 MiB or less each), seeded."""
    g = torch.Generator().manual_seed(0)
    left, out = max(1, int(mb * 1e6) // 4), list[tuple[str, torch.Tensor]]()
    while left:
        n = min(PIECE_FLOATS, left)
        out.append((f"param/{len(out)}", torch.randn(n, generator=g)))
        left -= n
    return out


def _snapshot(state: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What ``ShardState.snapshot`` does to a replica's state: a copy, and its digest."""
    from fthsdp.runtime.state import DIGEST, digest_of

    out = [(n, t.clone()) for n, t in state]
    return [*out, (DIGEST, torch.frombuffer(bytearray(digest_of(out)), dtype=torch.uint8))]


def cores() -> tuple[set[int], set[int]] | None:
    """(the source's training thread's core, every other core), or None where threads cannot be pinned."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    return ({mine[0]}, set(mine[1:])) if len(mine) >= 2 else None


def _source(mb: float, model: str, pin: bool, step: Any, stop: Any, out: mp.Queue[Any]) -> None:
    """The source replica: trains, serves ``mb`` MB, reports its steps' (start, end) wall times. Pinned, its
    catch-up threads (made by the server's constructor, and by its threads) run on the other cores, the training
    thread on its own."""
    from fthsdp.catchup.server import CatchupServer
    from fthsdp.examples.gpt import GPT, GPTConfig
    from lighthouse.epoch_view import EpochView
    from lighthouse.model import JOINING, Endpoints, EpochMember

    torch.set_num_threads(1)
    state = synthetic_state(mb)
    epoch = EpochView(JOB, 1, (EpochMember("joiner", INC, JOINING, 1, Endpoints()),), "", 0.0, "bench")
    split = cores() if pin else None
    if split:
        os.sched_setaffinity(0, split[1])  # this thread, and the threads it makes from now on
    srv = CatchupServer(job=JOB, replica_id="source", rank=0, world_size=1, snapshot=lambda: _snapshot(state),
                        epoch=lambda: epoch, token=TOKEN)
    if split:
        os.sched_setaffinity(0, split[0])  # the training thread: a core of its own
    out.put(srv.address)
    cfg = GPTConfig.named(model)
    torch.manual_seed(0)
    net = GPT(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4)
    tokens = torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    times: list[tuple[float, float]] = []
    try:
        while not stop.is_set():
            s = step.value
            srv.at_commit(s, active=True)
            t0 = time.time()
            logits = net(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            srv.before_update(s)
            opt.step()
            opt.zero_grad()
            times.append((t0, time.time()))
            step.value = s + 1
    finally:
        srv.close(drain_s=5.0)
        out.put(times)


def _wait(cond: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench catchup: timed out waiting for {what}")
        time.sleep(0.05)  # polling a condition, with a deadline


def bench_catchup(mb: float = 512.0, model: str = "reference", repeats: int = 3, warmup: int = 3,
                  steady: int = 8, pin: bool = True) -> CatchupResult:
    """See the module doc. ``warmup`` steps are left out; ``steady`` steps are timed before anything moves (and more
    between the fetches).
    ``pin``: the source's training thread on a core of its own (where there are two or more)."""
    from fthsdp.catchup.client import Fetch, Source

    if mb <= 0 or repeats < 1:
        raise ValueError("--mb must be positive and --repeats at least 1")
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    step, stop, out = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_source, args=(mb, model, pin, step, stop, out), daemon=True)
    proc.start()
    split = cores() if pin else None
    before = os.sched_getaffinity(0) if split else None
    try:
        if split:  # the joiner and the socket copy's processes (spawned from here) off the training core
            os.sched_setaffinity(0, split[1])
        address = out.get(timeout=300)
        _wait(lambda: step.value >= warmup + steady, "the source's steady steps", 600)
        nbytes = sum(t.numel() * t.element_size() for _, t in synthetic_state(mb))
        copies, fetches, windows, busy = [], [], [], []
        for _ in range(repeats):
            t0 = time.time()
            copies.append(socket_copy_mbps(nbytes, repeats=1))
            busy.append((t0, time.time()))
            t0 = time.time()
            f = Fetch([Source("source", address)], job=JOB, replica_id="joiner", rank=0, step=step.value + 1,
                      incarnation=INC, token=TOKEN, wait_s=120.0).start()
            res = f.result(timeout=600)
            windows.append((t0, time.time()))
            fetches.append((res.bytes, res.transfer_s, res.wait_s))
            del res, f
            s = step.value
            _wait(lambda s=s: step.value >= s + QUIET_BETWEEN + 1, "the source's steps after a fetch",  # type: ignore[misc]
                  600)
        stop.set()
        times: list[tuple[float, float]] = out.get(timeout=120)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        if before is not None:
            os.sched_setaffinity(0, before)
    def overlaps(a: float, b: float, spans: list[tuple[float, float]]) -> bool:
        return any(a < w1 and b > w0 for w0, w1 in spans)

    serving = [b - a for a, b in times if overlaps(a, b, windows)]
    copying = [(w0, w0 + wait) for (w0, _), (_, _, wait) in zip(windows, fetches, strict=True)]
    sending = [(w0 + wait, w1) for (w0, w1), (_, _, wait) in zip(windows, fetches, strict=True)]
    while_copying = [b - a for a, b in times if overlaps(a, b, copying)]
    while_sending = [b - a for a, b in times if overlaps(a, b, sending)]
    quiet = [b - a for a, b in times[warmup:] if not overlaps(a, b, windows + busy)]
    fetch_mbps = [n / max(t, 1e-9) / 1e6 for n, t, _ in fetches]
    best_fetch, best_copy = max(fetch_mbps), max(copies)
    return CatchupResult(
        mb=mb, bytes=nbytes, model=model, repeats=repeats, pinned=bool(split),
        transfer_ratio=round(best_fetch / best_copy, 3), transfer_mbps=round(best_fetch, 1),
        socket_copy_mbps=round(best_copy, 1), fetch_mbps_all=[round(x, 1) for x in fetch_mbps],
        socket_copy_mbps_all=[round(x, 1) for x in copies],
        snapshot_wait_s=[round(w, 3) for _, _, w in fetches],
        serve_step_ratio=round(statistics.median(serving) / statistics.median(quiet), 3),
        steady_step_s=round(statistics.median(quiet), 4), serving_step_s=round(statistics.median(serving), 4),
        steady_steps=len(quiet), serving_steps=len(serving),
        copying_step_s=round(statistics.median(while_copying), 4) if while_copying else None,
        sending_step_s=round(statistics.median(while_sending), 4) if while_sending else None,
        loadavg_1min=round(load_before, 2),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
